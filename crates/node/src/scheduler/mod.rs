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

pub mod config;
mod invariants;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};

use headroom_qos::model::is_sequential;
use headroom_qos::{
    CostModel, CostVector, Decision, IoRequest, NodeCapacity, Observed, OpKind, Phase, Policy,
    VolumeId, VolumeQos, build_policy,
};

use crate::clock::Clock;
use crate::global_pool::{self, WorkerUse};
use crate::sync::{lock, read, write};
use config::{DispatchMode, QosConfig};

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

/// Identifies a dispatched request until its completion is reported.
#[derive(Debug)]
pub struct Ticket {
    worker: usize,
    request: IoRequest,
    phase: Phase,
    sequential: bool,
    dispatched_ns: u64,
    /// Held back by the policy: dispatched later than by its own submission.
    held: bool,
    /// How the burst gate counts it in flight (released at completion).
    gate_slot: GateSlot,
    /// Counted in its volume's bursting requests at the gate (released at completion).
    gate_burst: bool,
    /// Never dispatched by the policy: its volume was removed while it was queued.
    orphan: bool,
    volume: Arc<VolumeHandle>,
}

impl Ticket {
    /// When the request reached the scheduler.
    pub fn arrival_ns(&self) -> u64 {
        self.request.arrival_ns
    }

    /// When the policy let it run.
    pub fn dispatched_ns(&self) -> u64 {
        self.dispatched_ns
    }

    /// The phase it ran in.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn desc(&self) -> IoDesc {
        IoDesc {
            op: self.request.op,
            offset_bytes: self.request.offset_bytes,
            len_bytes: self.request.len_bytes,
            syncs: 0,
        }
    }

    pub fn sequential(&self) -> bool {
        self.sequential
    }
}

/// Runs jobs the policy dispatched outside a caller's own submission (when a timer falls due).
pub trait Runner<J>: Send + Sync {
    fn run(&self, scheduler: &Arc<Scheduler<J>>, ready: Vec<Ready<J>>);
}

/// Per-volume counters by phase: what an operator reads in `volume show`.
#[derive(Debug, Default)]
pub struct PhaseCounters {
    /// Requests completed, per phase in [`Phase::ALL`] order.
    pub ios: [AtomicU64; 3],
    /// Payload bytes completed, per phase.
    pub bytes: [AtomicU64; 3],
    /// Time from arrival to completion summed over requests, ns, per phase.
    pub latency_ns: [AtomicU64; 3],
    /// Requests the policy held back (dispatched later, when a timer fell due or another
    /// request's turn let them run).
    pub throttled_ios: AtomicU64,
    /// Time those requests waited for the policy, ns.
    pub throttled_ns: AtomicU64,
}

/// A snapshot of [`PhaseCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PhaseStats {
    pub ios: [u64; 3],
    pub bytes: [u64; 3],
    pub latency_ns: [u64; 3],
    pub throttled_ios: u64,
    pub throttled_ns: u64,
}

impl PhaseCounters {
    pub fn snapshot(&self) -> PhaseStats {
        let load = |a: &[AtomicU64; 3]| {
            [
                a[0].load(Ordering::Relaxed),
                a[1].load(Ordering::Relaxed),
                a[2].load(Ordering::Relaxed),
            ]
        };
        PhaseStats {
            ios: load(&self.ios),
            bytes: load(&self.bytes),
            latency_ns: load(&self.latency_ns),
            throttled_ios: self.throttled_ios.load(Ordering::Relaxed),
            throttled_ns: self.throttled_ns.load(Ordering::Relaxed),
        }
    }
}

/// A volume as the scheduler knows it; sessions keep one per connection.
#[derive(Debug)]
pub struct VolumeHandle {
    /// The store's volume id.
    pub key: u64,
    id: VolumeId,
    home_worker: usize,
    /// End of the last request (IOCost's sequential test).
    last_end_bytes: AtomicU64,
    /// Spray position for 1-to-N dispatch.
    spray: AtomicUsize,
    pub counters: PhaseCounters,
    qos: Mutex<VolumeQos>,
    /// Bursting requests of this volume (burst requests, and baseline requests admitted while
    /// it was bursting) waiting at the burst gate or in flight: while there are any, the
    /// volume is bursting and its baseline requests take the gate too. Changed only under the
    /// gate's lock.
    gate_burst_requests: AtomicUsize,
    /// The volume runs on its home worker only, with its whole QoS: a rate of it is too small
    /// to split over the workers (see [`too_small_to_split`]).
    pinned: AtomicBool,
}

impl VolumeHandle {
    /// The volume's whole QoS (not a worker's share).
    pub fn qos(&self) -> VolumeQos {
        *lock(&self.qos)
    }
}

struct Pending<J> {
    job: J,
    volume: Arc<VolumeHandle>,
    sequential: bool,
    /// The submission that enqueued it is still draining (a dispatch now is not a hold-back).
    own_drain: bool,
}

struct WorkerState<J> {
    policy: Box<dyn Policy>,
    cost_model: CostModel,
    pending: HashMap<u64, Pending<J>>,
    next_request_id: u64,
    /// The wake-up time armed for this worker (`u64::MAX`: none).
    armed_ns: u64,
    /// This worker's share of the node (per second), set by the global pool.
    share: CostVector,
    /// Cost dispatched since the last rebalancing, all phases and baseline phase only.
    used: CostVector,
    used_baseline: CostVector,
    /// The policy held requests back since the last rebalancing.
    held_back: bool,
    /// Cost dispatched since start, never reset (node utilisation per dimension:
    /// [`Scheduler::dispatched_cost_total`]).
    dispatched_total: CostVector,
    /// Cost dispatched in the baseline phase since start, never reset.
    baseline_total: CostVector,
    /// Times the policy held requests back since start, never reset.
    held_back_total: u64,
}

struct Worker<J> {
    state: Mutex<WorkerState<J>>,
    /// Requests queued in the policy (read without the lock by stealing dispatch).
    queued: AtomicUsize,
}

/// The node's scheduler workers.
pub struct Scheduler<J> {
    clock: Clock,
    workers: Vec<Worker<J>>,
    dispatch: DispatchMode,
    volumes: RwLock<HashMap<u64, Arc<VolumeHandle>>>,
    next_volume_id: std::sync::atomic::AtomicU32,
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
            .map(|index| {
                let mut params = config.params;
                params.seed ^= 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index as u64 + 1);
                let policy = build_policy(kind, share, &params);
                Worker {
                    state: Mutex::new(WorkerState {
                        policy,
                        cost_model: config.cost_model.clone(),
                        pending: HashMap::new(),
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
            })
            .collect();
        let policy_name = lock(&workers[0].state).policy.name();
        let wakeups = Arc::new(Wakeups {
            deadlines: Mutex::new(WakeState {
                deadline_ns: vec![u64::MAX; count],
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let scheduler = Arc::new_cyclic(|me| Scheduler {
            clock,
            workers,
            dispatch: config.dispatch,
            volumes: RwLock::new(HashMap::new()),
            next_volume_id: std::sync::atomic::AtomicU32::new(0),
            wakeups: Arc::clone(&wakeups),
            runner,
            gate: BurstGate::new(config, device_parallelism),
            pool: (config.global_pool && count > 1).then(|| GlobalPool {
                node: Mutex::new(config.capacity.per_second),
                period_ns: config.params.window_ns.max(global_pool::MIN_PERIOD_NS),
                last_ns: AtomicU64::new(clock.now_ns()),
            }),
            capacity_per_second: Mutex::new(config.capacity.per_second),
            policy_name,
            me: me.clone(),
        });
        let weak = Arc::downgrade(&scheduler);
        std::thread::Builder::new()
            .name("headroom-wake".into())
            .spawn(move || wake_loop(weak, wakeups, clock))
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
        lock(&self.wakeups.deadlines).stop = true;
        self.wakeups.changed.notify_all();
    }

    /// The share of a volume's QoS one worker enforces, and on which workers. A volume
    /// [`too_small_to_split`] runs whole on its home worker, as under 1-to-1
    /// ([`Scheduler::pick_worker`] sends its requests there).
    fn shares(&self, home: usize, qos: &VolumeQos) -> Vec<(usize, VolumeQos)> {
        let n = self.workers.len();
        match self.dispatch {
            DispatchMode::OneToOne => vec![(home, *qos)],
            DispatchMode::OneToN | DispatchMode::Stealing if too_small_to_split(qos, n as u64) => {
                vec![(home, *qos)]
            }
            DispatchMode::OneToN | DispatchMode::Stealing => {
                let share = qos.scaled(1, n as u64);
                (0..n).map(|w| (w, share)).collect()
            }
        }
    }

    /// Registers a volume (or changes its QoS if it is known) and returns its handle.
    pub fn add_volume(&self, key: u64, qos: &VolumeQos) -> Arc<VolumeHandle> {
        if let Some(handle) = self.handle(key) {
            self.update_qos(&handle, qos);
            return handle;
        }
        // Held while registering, so two sessions that meet a new volume at once register it
        // once (lock order: volumes, then a worker).
        let mut volumes = write(&self.volumes);
        if let Some(handle) = volumes.get(&key) {
            return Arc::clone(handle);
        }
        // The policies' ids are the scheduler's own, dense and never reused (4 billion volume
        // creations per process), so store ids of any size fit.
        let id = self.next_volume_id.fetch_add(1, Ordering::Relaxed);
        let handle = Arc::new(VolumeHandle {
            key,
            id,
            home_worker: (key % self.workers.len() as u64) as usize,
            last_end_bytes: AtomicU64::new(u64::MAX / 2),
            spray: AtomicUsize::new(0),
            counters: PhaseCounters::default(),
            qos: Mutex::new(*qos),
            gate_burst_requests: AtomicUsize::new(0),
            pinned: AtomicBool::new(too_small_to_split(qos, self.workers.len() as u64)),
        });
        let now = self.clock.now_ns();
        for (w, share) in self.shares(handle.home_worker, qos) {
            lock(&self.workers[w].state)
                .policy
                .add_volume(now, id, &share);
        }
        volumes.insert(key, Arc::clone(&handle));
        handle
    }

    /// The handle of a registered volume.
    pub fn handle(&self, key: u64) -> Option<Arc<VolumeHandle>> {
        read(&self.volumes).get(&key).cloned()
    }

    /// Changes a volume's QoS live: the policies keep its credit balance (clamped to a smaller
    /// bucket) and never refill it, and queued requests are judged by the new QoS at once.
    pub fn update_qos(&self, handle: &Arc<VolumeHandle>, qos: &VolumeQos) {
        *lock(&handle.qos) = *qos;
        handle.pinned.store(
            too_small_to_split(qos, self.workers.len() as u64),
            Ordering::Relaxed,
        );
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        for (w, share) in self.shares(handle.home_worker, qos) {
            let mut state = lock(&self.workers[w].state);
            state.policy.update_qos(now, handle.id, &share);
            self.drain(w, &mut state, now, &mut ready);
        }
        self.gate.admit(&mut ready, 0);
        self.run_elsewhere(ready);
    }

    /// Removes a volume; its queued requests are handed to the runner, which fails them (the
    /// volume is gone from the store by then).
    pub fn remove_volume(&self, key: u64) {
        let Some(handle) = write(&self.volumes).remove(&key) else {
            return;
        };
        let now = self.clock.now_ns();
        let mut orphans = Vec::new();
        for (w, worker) in self.workers.iter().enumerate() {
            let mut state = lock(&worker.state);
            state.policy.remove_volume(now, handle.id);
            let ids: Vec<u64> = state
                .pending
                .iter()
                .filter(|(_, p)| p.volume.key == key)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                if let Some(p) = state.pending.remove(&id) {
                    orphans.push(Ready {
                        job: p.job,
                        ticket: Ticket {
                            worker: w,
                            request: orphan_request(id, handle.id, now),
                            phase: Phase::Baseline,
                            sequential: false,
                            dispatched_ns: now,
                            held: true,
                            gate_slot: GateSlot::Outside,
                            gate_burst: false,
                            orphan: true,
                            volume: Arc::clone(&handle),
                        },
                    });
                }
            }
            worker
                .queued
                .store(state.policy.queued_requests(), Ordering::Relaxed);
        }
        self.run_elsewhere(orphans);
    }

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

    /// Sets a volume's credit balances (a restart restoring saved balances), split evenly over
    /// the workers that hold a share of its QoS. Never above a bucket's capacity.
    pub fn restore_credits(&self, handle: &VolumeHandle, iops: Option<u64>, bytes: Option<u64>) {
        let now = self.clock.now_ns();
        let qos = handle.qos();
        let shares = self.shares(handle.home_worker, &qos);
        let n = shares.len() as u64;
        for (i, (w, _)) in shares.into_iter().enumerate() {
            // The first `total % n` workers get one more, so the parts add up to the total.
            let part = |total: u64| total / n + u64::from((i as u64) < total % n);
            lock(&self.workers[w].state).policy.restore_credits(
                now,
                handle.id,
                iops.map(part),
                bytes.map(part),
            );
        }
    }

    /// Picks the worker for one request of `handle`.
    fn pick_worker(&self, handle: &VolumeHandle) -> usize {
        let n = self.workers.len();
        if n == 1 {
            return 0;
        }
        if handle.pinned.load(Ordering::Relaxed) {
            return handle.home_worker;
        }
        match self.dispatch {
            DispatchMode::OneToN => handle.spray.fetch_add(1, Ordering::Relaxed) % n,
            DispatchMode::OneToOne => handle.home_worker,
            DispatchMode::Stealing => {
                let home = handle.home_worker;
                if self.workers[home].queued.load(Ordering::Relaxed) == 0 {
                    return home;
                }
                (0..n)
                    .map(|k| (home + k) % n)
                    .find(|&w| self.workers[w].queued.load(Ordering::Relaxed) == 0)
                    .unwrap_or(home)
            }
        }
    }

    /// Queues a request and appends whatever the policy lets run now to `ready` (usually the
    /// request itself, when its volume and the node have room).
    pub fn submit(
        &self,
        handle: &Arc<VolumeHandle>,
        io: IoDesc,
        job: J,
        ready: &mut Vec<Ready<J>>,
    ) {
        let w = self.pick_worker(handle);
        let end = io.offset_bytes.saturating_add(u64::from(io.len_bytes));
        let previous_end = handle.last_end_bytes.swap(end, Ordering::Relaxed);
        let sequential = is_sequential(previous_end, io.offset_bytes);
        let mut state = lock(&self.workers[w].state);
        let now = self.clock.now_ns();
        let id = state.next_request_id;
        state.next_request_id = id.wrapping_add(1);
        let mut cost = state.cost_model.estimate(io.op, io.len_bytes, sequential);
        if io.syncs > 0 {
            // A FUA request's sync covers its own write; a FLUSH's each cover a device.
            let sync_len = if io.op == OpKind::Flush {
                0
            } else {
                io.len_bytes
            };
            let sync = state.cost_model.estimate_sync(sync_len);
            for _ in 0..io.syncs.min(MAX_CHARGED_SYNCS) {
                cost = cost.saturating_add(sync);
            }
        }
        state.pending.insert(
            id,
            Pending {
                job,
                volume: Arc::clone(handle),
                sequential,
                own_drain: true,
            },
        );
        state.policy.enqueue(
            now,
            IoRequest {
                id,
                volume: handle.id,
                op: io.op,
                offset_bytes: io.offset_bytes,
                len_bytes: io.len_bytes,
                cost,
                arrival_ns: now,
            },
        );
        let first = ready.len();
        self.drain(w, &mut state, now, ready);
        // The request is now either dispatched (in `ready`) or held back by the policy.
        if let Some(p) = state.pending.get_mut(&id) {
            p.own_drain = false;
        }
        drop(state);
        self.gate.admit(ready, first);
        self.maybe_rebalance(now, ready);
    }

    /// Reports a completed request; appends requests that may run now to `ready`.
    pub fn complete(&self, ticket: Ticket, ready: &mut Vec<Ready<J>>) {
        self.complete_at(ticket, self.clock.now_ns(), ready);
    }

    /// [`Scheduler::complete`] with the time of completion already read from the node's
    /// clock (the session reads it once for its statistics and for this).
    pub fn complete_at(&self, ticket: Ticket, now: u64, ready: &mut Vec<Ready<J>>) {
        let payload = ticket.request.payload_bytes();
        let phase = ticket.phase as usize;
        let counters = &ticket.volume.counters;
        counters.ios[phase].fetch_add(1, Ordering::Relaxed);
        counters.bytes[phase].fetch_add(payload, Ordering::Relaxed);
        counters.latency_ns[phase].fetch_add(
            now.saturating_sub(ticket.request.arrival_ns),
            Ordering::Relaxed,
        );
        if ticket.held {
            counters.throttled_ios.fetch_add(1, Ordering::Relaxed);
            counters.throttled_ns.fetch_add(
                ticket
                    .dispatched_ns
                    .saturating_sub(ticket.request.arrival_ns),
                Ordering::Relaxed,
            );
        }
        let observed = Observed {
            service_ns: now.saturating_sub(ticket.dispatched_ns),
            queue_ns: 0,
        };
        self.gate.release(&ticket, ready);
        if ticket.orphan {
            // The policy never dispatched it (its volume is gone): nothing to report.
            return;
        }
        self.maybe_rebalance(now, ready);
        let mut state = lock(&self.workers[ticket.worker].state);
        let WorkerState {
            policy, cost_model, ..
        } = &mut *state;
        cost_model.observe(
            ticket.request.op,
            ticket.request.len_bytes,
            ticket.sequential,
            &ticket.request.cost,
            observed,
        );
        policy.complete(now, &ticket.request, observed);
        // The wake-up thread will come for a due timer; if it is late, help it.
        if now >= state.armed_ns {
            let from = ready.len();
            self.drain(ticket.worker, &mut state, now, ready);
            drop(state);
            self.gate.admit(ready, from);
        }
    }

    /// Asks the policy for everything that may run now; arms the wake-up for the rest.
    fn drain(&self, w: usize, state: &mut WorkerState<J>, now: u64, ready: &mut Vec<Ready<J>>) {
        loop {
            match state.policy.next(now) {
                Decision::Dispatch(request, phase) => {
                    state.used = state.used.saturating_add(request.cost);
                    state.dispatched_total = state.dispatched_total.saturating_add(request.cost);
                    if phase == Phase::Baseline {
                        state.used_baseline = state.used_baseline.saturating_add(request.cost);
                        state.baseline_total = state.baseline_total.saturating_add(request.cost);
                    }
                    let Some(p) = state.pending.remove(&request.id) else {
                        // The policy dispatched a request we do not hold: nothing to run.
                        tracing::error!("policy dispatched unknown request {}", request.id);
                        continue;
                    };
                    ready.push(Ready {
                        job: p.job,
                        ticket: Ticket {
                            worker: w,
                            request,
                            phase,
                            sequential: p.sequential,
                            dispatched_ns: now,
                            held: !p.own_drain,
                            gate_slot: GateSlot::Outside,
                            gate_burst: false,
                            orphan: false,
                            volume: p.volume,
                        },
                    });
                }
                Decision::WaitUntil(at_ns) => {
                    state.held_back = true;
                    state.held_back_total += 1;
                    if at_ns != state.armed_ns {
                        state.armed_ns = at_ns;
                        self.wakeups.arm(w, at_ns);
                    }
                    break;
                }
                Decision::Idle => {
                    state.armed_ns = u64::MAX;
                    break;
                }
            }
        }
        self.workers[w]
            .queued
            .store(state.policy.queued_requests(), Ordering::Relaxed);
    }

    /// Moves capacity between the workers if a rebalancing period has passed
    /// (`node::global_pool`); appends what the new shares let run to `ready`. Runs on whichever
    /// thread submits or completes a request first after the period: an idle node does no work.
    fn maybe_rebalance(&self, now: u64, ready: &mut Vec<Ready<J>>) {
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
    fn rebalance(&self, now: u64, elapsed_ns: u64, ready: &mut Vec<Ready<J>>) {
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
    fn apply_shares(&self, now: u64, shares: Vec<CostVector>, ready: &mut Vec<Ready<J>>) {
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

    /// Each worker's current share of the node (per second).
    pub fn worker_shares(&self) -> Vec<CostVector> {
        self.workers.iter().map(|w| lock(&w.state).share).collect()
    }

    /// A timer of worker `w` fell due.
    fn wake(self: &Arc<Self>, w: usize) {
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        {
            let mut state = lock(&self.workers[w].state);
            // Armed again for a later time by someone else: nothing is due.
            if state.armed_ns > now && state.armed_ns != u64::MAX {
                self.wakeups.arm(w, state.armed_ns);
                return;
            }
            state.armed_ns = u64::MAX;
            self.drain(w, &mut state, now, &mut ready);
        }
        self.gate.admit(&mut ready, 0);
        if !ready.is_empty() {
            self.runner.run(self, ready);
        }
    }

    /// Runs jobs released outside a submission (QoS change, removal).
    fn run_elsewhere(&self, ready: Vec<Ready<J>>) {
        if ready.is_empty() {
            return;
        }
        if let Some(me) = self.me.upgrade() {
            self.runner.run(&me, ready);
        }
    }
}

fn orphan_request(id: u64, volume: VolumeId, now: u64) -> IoRequest {
    IoRequest {
        id,
        volume,
        op: OpKind::Flush,
        offset_bytes: 0,
        len_bytes: 0,
        cost: headroom_qos::CostVector::ZERO,
        arrival_ns: now,
    }
}

/// How the burst gate counts a request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GateSlot {
    /// Not counted (no gate, an orphan, or not yet admitted).
    Outside,
    /// A baseline request of a volume that is not bursting.
    Protected,
    /// A burst request, or a baseline request of a bursting volume.
    Bursting,
}

/// Bounds the burst work in flight (module doc).
struct BurstGate<J> {
    /// Most `Bursting` requests in flight; the gate also keeps `Bursting` + `Protected`
    /// requests in flight at most `limit + 1` when it starts a `Bursting` one (`usize::MAX`:
    /// no gate).
    limit: usize,
    state: Mutex<GateState<J>>,
}

struct GateState<J> {
    protected: usize,
    bursting: usize,
    /// Baseline requests of bursting volumes, released before any burst request.
    waiting_baseline: std::collections::VecDeque<Ready<J>>,
    /// Burst requests, in dispatch order.
    waiting: std::collections::VecDeque<Ready<J>>,
}

impl<J> GateState<J> {
    /// Whether one more `Bursting` request may start: burst work keeps one of the device's
    /// `limit + 1` channels for baseline work, and never makes the device queue.
    fn bursting_fits(&self, limit: usize) -> bool {
        self.bursting < limit && self.bursting + self.protected <= limit
    }

    fn start(&mut self, mut item: Ready<J>, slot: GateSlot, ready: &mut Vec<Ready<J>>) {
        match slot {
            GateSlot::Protected => self.protected += 1,
            GateSlot::Bursting => self.bursting += 1,
            GateSlot::Outside => {}
        }
        item.ticket.gate_slot = slot;
        ready.push(item);
    }
}

impl<J> BurstGate<J> {
    fn new(config: &QosConfig, device_parallelism: Option<u32>) -> Self {
        // Wild is the reference without isolation: it never gates.
        let isolates = config.policy.kind() != Some(headroom_qos::PolicyKind::Wild);
        let limit = match config
            .burst_in_flight
            .or_else(|| device_parallelism.map(|p| p.saturating_sub(1).max(1)))
        {
            Some(n) if n > 0 && isolates => n as usize,
            _ => usize::MAX,
        };
        BurstGate {
            limit,
            state: Mutex::new(GateState {
                protected: 0,
                bursting: 0,
                waiting_baseline: std::collections::VecDeque::new(),
                waiting: std::collections::VecDeque::new(),
            }),
        }
    }

    /// Passes `ready[from..]` through the gate (module doc): baseline requests of volumes that
    /// are not bursting stay; other requests stay if they fit and nothing of their class or a
    /// higher one waits, and wait otherwise.
    fn admit(&self, ready: &mut Vec<Ready<J>>, from: usize) {
        if self.limit == usize::MAX || ready.len() <= from {
            return;
        }
        let mut gate = lock(&self.state);
        let dispatched = ready.split_off(from);
        for mut item in dispatched {
            let volume = &item.ticket.volume;
            let burst = item.ticket.phase != Phase::Baseline;
            if !burst && volume.gate_burst_requests.load(Ordering::Relaxed) == 0 {
                gate.start(item, GateSlot::Protected, ready);
                continue;
            }
            volume.gate_burst_requests.fetch_add(1, Ordering::Relaxed);
            item.ticket.gate_burst = true;
            let queue_empty = if burst {
                gate.waiting_baseline.is_empty() && gate.waiting.is_empty()
            } else {
                gate.waiting_baseline.is_empty()
            };
            if queue_empty && gate.bursting_fits(self.limit) {
                gate.start(item, GateSlot::Bursting, ready);
            } else if burst {
                gate.waiting.push_back(item);
            } else {
                gate.waiting_baseline.push_back(item);
            }
        }
    }

    /// A request completed: releases waiting requests while they fit.
    fn release(&self, ticket: &Ticket, ready: &mut Vec<Ready<J>>) {
        if self.limit == usize::MAX {
            return;
        }
        let mut gate = lock(&self.state);
        match ticket.gate_slot {
            GateSlot::Protected => gate.protected = gate.protected.saturating_sub(1),
            GateSlot::Bursting => gate.bursting = gate.bursting.saturating_sub(1),
            GateSlot::Outside => {}
        }
        if ticket.gate_burst {
            let count = &ticket.volume.gate_burst_requests;
            count.store(
                count.load(Ordering::Relaxed).saturating_sub(1),
                Ordering::Relaxed,
            );
        }
        while gate.bursting_fits(self.limit) {
            let Some(item) = gate
                .waiting_baseline
                .pop_front()
                .or_else(|| gate.waiting.pop_front())
            else {
                break;
            };
            gate.start(item, GateSlot::Bursting, ready);
        }
    }
}

/// Cumulative counters of the whole scheduler ([`Scheduler::demand_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DemandCounters {
    pub dispatched: CostVector,
    pub baseline: CostVector,
    pub held_back: u64,
}

/// The node's capacity and when it was last split between the workers.
struct GlobalPool {
    node: Mutex<CostVector>,
    period_ns: u64,
    last_ns: AtomicU64,
}

const NS_PER_S: u64 = 1_000_000_000;

/// Wake-up times per worker, served by one thread.
struct Wakeups {
    deadlines: Mutex<WakeState>,
    changed: Condvar,
}

struct WakeState {
    deadline_ns: Vec<u64>,
    stop: bool,
}

impl Wakeups {
    /// Asks for worker `w` to be woken at `at_ns` (keeps an earlier request).
    fn arm(&self, w: usize, at_ns: u64) {
        let mut state = lock(&self.deadlines);
        let earliest_before = state.deadline_ns.iter().copied().min().unwrap_or(u64::MAX);
        if at_ns < state.deadline_ns[w] {
            state.deadline_ns[w] = at_ns;
        }
        if at_ns < earliest_before {
            self.changed.notify_one();
        }
    }
}

fn wake_loop<J: Send + 'static>(
    scheduler: Weak<Scheduler<J>>,
    wakeups: Arc<Wakeups>,
    clock: Clock,
) {
    crate::clock::wake_on_time();
    let mut due = Vec::new();
    loop {
        {
            let mut state = lock(&wakeups.deadlines);
            loop {
                if state.stop {
                    return;
                }
                let now = clock.now_ns();
                let earliest = state.deadline_ns.iter().copied().min().unwrap_or(u64::MAX);
                if earliest <= now {
                    for (w, deadline) in state.deadline_ns.iter_mut().enumerate() {
                        if *deadline <= now {
                            *deadline = u64::MAX;
                            due.push(w);
                        }
                    }
                    break;
                }
                // Without a deadline, check every 100 ms whether the scheduler still exists.
                let wait = if earliest == u64::MAX {
                    std::time::Duration::from_millis(100)
                } else {
                    clock.until(earliest)
                };
                state = wakeups
                    .changed
                    .wait_timeout(state, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if scheduler.strong_count() == 0 {
                    return;
                }
            }
        }
        let Some(scheduler) = scheduler.upgrade() else {
            return;
        };
        for w in due.drain(..) {
            scheduler.wake(w);
        }
    }
}

/// Whether splitting `qos` over `workers` would round one of its finite, non-zero rates (or
/// credit refills) down to zero per worker: a ceiling of 3 IOPS over 4 workers would give each
/// 0 IOPS, and the volume would never run. Such a volume runs whole on one worker instead
/// (rounding up would let it exceed its ceiling up to `workers` times).
fn too_small_to_split(qos: &VolumeQos, workers: u64) -> bool {
    let small = |r: u64| r > 0 && r != u64::MAX && r < workers;
    let rate_small = |r: headroom_qos::IoRate| small(r.iops) || small(r.bytes_per_s);
    let bucket_small = |b: &Option<headroom_qos::CreditBucketSpec>| {
        b.as_ref().is_some_and(|b| small(b.refill_per_s))
    };
    rate_small(qos.baseline)
        || rate_small(qos.ceiling)
        || matches!(&qos.burst, headroom_qos::BurstMode::Credits(c)
            if bucket_small(&c.iops) || bucket_small(&c.bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_qos::model::{CpuModel, DeviceModel, IoCostModel};
    use headroom_qos::{CostVector, NodeCapacity, PolicyKind};
    use std::time::{Duration, Instant};

    use super::config::PolicyChoice;

    /// Keeps what the wake-up thread releases, for the test to run.
    #[derive(Default)]
    struct Collect(Mutex<Vec<Ready<u32>>>);
    impl Runner<u32> for Collect {
        fn run(&self, _: &Arc<Scheduler<u32>>, ready: Vec<Ready<u32>>) {
            lock(&self.0).extend(ready);
        }
    }

    /// The device model of [`scheduler`]: a 4 KiB random read costs 50,000 units.
    const TEST_DEVICE: IoCostModel = IoCostModel {
        rbps: 200_000_000,
        rseqiops: 48_828,
        rrandiops: 20_000,
        wbps: 150_000_000,
        wseqiops: 36_621,
        wrandiops: 15_000,
    };

    /// One worker, Burst, a device capacity so large that the pacer hardly binds (10¹² units
    /// per second; a 4 KiB random read costs 50,000), and a gate of two requests.
    fn scheduler() -> (Arc<Scheduler<u32>>, Arc<Collect>) {
        let model = TEST_DEVICE;
        let config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            capacity: NodeCapacity::new(CostVector::new(
                u64::MAX,
                u64::MAX,
                u64::MAX,
                1_000_000_000_000,
            )),
            cost_model: CostModel::new(CpuModel::default(), DeviceModel::Linear(model)),
            workers: 1,
            burst_in_flight: Some(2),
            ..QosConfig::default()
        };
        let collect = Arc::new(Collect::default());
        let s = Scheduler::start(&config, Clock::new(), collect.clone(), None).expect("scheduler");
        (s, collect)
    }

    fn read(offset_bytes: u64) -> IoDesc {
        IoDesc {
            op: OpKind::Read,
            offset_bytes,
            len_bytes: 4096,
            syncs: 0,
        }
    }

    /// Everything the policy dispatched (by a submission or by the wake-up thread), once the
    /// policy holds nothing more for `handle` (waits up to a deadline for the wake-up thread).
    fn dispatched(
        s: &Scheduler<u32>,
        collect: &Collect,
        handle: &VolumeHandle,
        mut ready: Vec<Ready<u32>>,
    ) -> Vec<Ready<u32>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while s.queued_requests(handle) > 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(
            s.queued_requests(handle),
            0,
            "the policy never released everything"
        );
        ready.append(&mut lock(&collect.0));
        ready.sort_by_key(|r| r.job);
        ready
    }

    fn waiting(s: &Scheduler<u32>) -> usize {
        lock(&s.gate.state).waiting.len()
    }

    #[test]
    fn a_request_is_charged_every_sync_it_causes() {
        let (s, collect) = scheduler();
        let volume = s.add_volume(1, &VolumeQos::default());
        let model = CostModel::new(CpuModel::default(), DeviceModel::Linear(TEST_DEVICE));
        let charged = |desc: IoDesc| {
            let before = s.dispatched_cost_total();
            let mut ready = Vec::new();
            s.submit(&volume, desc, 0, &mut ready);
            let ran = dispatched(&s, &collect, &volume, ready);
            let cost = s.dispatched_cost_total().saturating_sub(before);
            for r in ran {
                s.complete(r.ticket, &mut Vec::new());
            }
            cost
        };
        let write = IoDesc {
            op: OpKind::Write,
            offset_bytes: 1 << 30,
            len_bytes: 4096,
            syncs: 0,
        };
        // The online corrections only scale estimates up (from 1000 permille), and may move
        // between requests here: compare within that.
        let plain = charged(write);
        // Far from the first (both random, as the cost model sees them).
        let fua = charged(IoDesc {
            syncs: 1,
            offset_bytes: 3 << 30,
            ..write
        });
        let sync = model.estimate_sync(4096);
        assert!(
            fua.cpu_ns >= plain.cpu_ns + sync.cpu_ns,
            "{fua:?} {plain:?}"
        );
        assert!(fua.device_units >= plain.device_units + sync.device_units);
        assert_eq!((fua.ingress_bytes, fua.egress_bytes), (4096, 0));
        let flush = IoDesc {
            op: OpKind::Flush,
            offset_bytes: 0,
            len_bytes: 0,
            syncs: 3,
        };
        let sync = model.estimate_sync(0);
        let three = charged(flush);
        assert!(three.cpu_ns >= 3 * sync.cpu_ns, "{three:?}");
        assert!(three.device_units >= 3 * sync.device_units);
        let none = charged(IoDesc { syncs: 0, ..flush });
        assert!(
            none.cpu_ns < sync.cpu_ns / 10,
            "a FLUSH's own work is small: {none:?}"
        );
        // Bounded: a FLUSH of a pool of a thousand dirty devices pays for MAX_CHARGED_SYNCS.
        let many = charged(IoDesc {
            syncs: 1_000,
            ..flush
        });
        assert!(many.cpu_ns >= u64::from(MAX_CHARGED_SYNCS) * sync.cpu_ns);
        assert!(many.cpu_ns < 200 * sync.cpu_ns, "{many:?}");
        s.stop();
    }

    #[test]
    fn a_ceiling_below_the_worker_count_still_runs_under_one_to_n() {
        // 3 IOPS over 4 workers would be 0 IOPS per worker: the volume runs whole on its home
        // worker instead, under every policy, and its first request runs at once.
        for kind in PolicyKind::ALL {
            let config = QosConfig {
                policy: PolicyChoice::Policy(kind),
                workers: 4,
                dispatch: DispatchMode::OneToN,
                ..QosConfig::default()
            };
            let collect = Arc::new(Collect::default());
            let s =
                Scheduler::start(&config, Clock::new(), collect.clone(), None).expect("scheduler");
            let tiny = VolumeQos::fixed(headroom_qos::IoRate::new(3, u64::MAX));
            let volume = s.add_volume(7, &tiny);
            let mut ready = Vec::new();
            s.submit(&volume, read(0), 0, &mut ready);
            let ran = dispatched(&s, &collect, &volume, ready);
            assert_eq!(ran.len(), 1, "{kind}: the request never ran");
            // A QoS that splits again spreads the volume over the workers again.
            s.update_qos(
                &volume,
                &VolumeQos::fixed(headroom_qos::IoRate::new(4_000, u64::MAX)),
            );
            assert!(!volume.pinned.load(Ordering::Relaxed), "{kind}");
            s.stop();
        }
        assert!(too_small_to_split(
            &VolumeQos::fixed(headroom_qos::IoRate::new(u64::MAX, 3)),
            4
        ));
        assert!(!too_small_to_split(&VolumeQos::default(), 4));
        assert!(!too_small_to_split(
            &VolumeQos::fixed(headroom_qos::IoRate::new(3, u64::MAX)),
            1
        ));
    }

    #[test]
    fn burst_work_in_flight_is_bounded_and_released_by_completions() {
        let (s, collect) = scheduler();
        let burster = s.add_volume(1, &VolumeQos::default());
        let mut ready = Vec::new();
        for i in 0..5u32 {
            // Far apart: random reads.
            s.submit(&burster, read(u64::from(i) << 30), i, &mut ready);
        }
        // The policy lets all five go; the gate lets two run and holds three, in order.
        let mut running = dispatched(&s, &collect, &burster, ready);
        assert_eq!(
            running.iter().map(|r| r.job).collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert!(running.iter().all(|r| r.ticket.phase() != Phase::Baseline));
        assert_eq!(waiting(&s), 3);
        let mut released = Vec::new();
        s.complete(running.remove(0).ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![2]);
        assert_eq!(waiting(&s), 2);
        s.stop();
    }

    #[test]
    fn the_global_pool_rebalances_no_faster_than_its_shortest_period() {
        // A 1 ms policy window still rebalances every 10 ms; a longer window sets the period.
        for (window_ns, period_ns) in [(1_000_000, 10_000_000), (50_000_000, 50_000_000)] {
            let mut config = QosConfig {
                policy: PolicyChoice::Policy(PolicyKind::Burst),
                workers: 2,
                ..QosConfig::default()
            };
            config.params.window_ns = window_ns;
            let collect = Arc::new(Collect::default());
            let s = Scheduler::start(&config, Clock::new(), collect, None).expect("scheduler");
            assert_eq!(s.pool.as_ref().map(|p| p.period_ns), Some(period_ns));
        }
    }

    #[test]
    fn the_global_pool_lends_an_idle_workers_capacity_to_a_busy_one() {
        let config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            capacity: NodeCapacity::new(CostVector::new(
                u64::MAX,
                u64::MAX,
                u64::MAX,
                1_000_000_000,
            )),
            workers: 2,
            dispatch: DispatchMode::OneToOne,
            ..QosConfig::default()
        };
        let collect = Arc::new(Collect::default());
        let s = Scheduler::start(&config, Clock::new(), collect, None).expect("scheduler");
        let device = |v: &CostVector| v.dims()[3];
        assert_eq!(
            s.worker_shares().iter().map(device).collect::<Vec<_>>(),
            vec![500_000_000; 2]
        );
        // Over 10 ms, worker 0 used its whole share and held requests back; worker 1 idled.
        {
            let mut busy = lock(&s.workers[0].state);
            busy.used = CostVector::new(0, 0, 0, 5_000_000);
            busy.held_back = true;
        }
        let mut ready = Vec::new();
        s.rebalance(s.clock.now_ns(), 10_000_000, &mut ready);
        let shares: Vec<u64> = s.worker_shares().iter().map(device).collect();
        assert_eq!(shares, vec![975_000_000, 25_000_000]);
        // Worker 1's tenants wake up within their baseline and fill its share: the next period
        // gives it its static half back.
        {
            let mut busy = lock(&s.workers[0].state);
            busy.used = CostVector::new(0, 0, 0, 9_000_000);
            busy.held_back = true;
            let mut woken = lock(&s.workers[1].state);
            woken.used = CostVector::new(0, 0, 0, 250_000);
            woken.used_baseline = woken.used;
            woken.held_back = true;
        }
        s.rebalance(s.clock.now_ns(), 10_000_000, &mut ready);
        let shares: Vec<u64> = s.worker_shares().iter().map(device).collect();
        assert_eq!(shares, vec![500_000_000, 500_000_000]);
        s.stop();
    }

    /// A gate of two requests, and a ready request of `volume` dispatched in `phase`.
    fn gate_of_two() -> BurstGate<u32> {
        let config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            burst_in_flight: Some(2),
            ..QosConfig::default()
        };
        BurstGate::new(&config, None)
    }

    fn volume(key: u64) -> Arc<VolumeHandle> {
        Arc::new(VolumeHandle {
            key,
            id: key as VolumeId,
            home_worker: 0,
            last_end_bytes: AtomicU64::new(0),
            spray: AtomicUsize::new(0),
            counters: PhaseCounters::default(),
            qos: Mutex::new(VolumeQos::default()),
            gate_burst_requests: AtomicUsize::new(0),
            pinned: AtomicBool::new(false),
        })
    }

    fn dispatched_in(volume: &Arc<VolumeHandle>, phase: Phase, job: u32) -> Ready<u32> {
        Ready {
            job,
            ticket: Ticket {
                worker: 0,
                request: orphan_request(u64::from(job), volume.id, 0),
                phase,
                sequential: false,
                dispatched_ns: 0,
                held: false,
                gate_slot: GateSlot::Outside,
                gate_burst: false,
                orphan: false,
                volume: Arc::clone(volume),
            },
        }
    }

    /// A gate of two with burst requests 1 and 2 of volume 1 running and 3 waiting; volume 2
    /// is a victim that has sent nothing yet.
    #[allow(clippy::type_complexity)]
    fn gate_full_of_burst_work() -> (
        BurstGate<u32>,
        Arc<VolumeHandle>,
        Arc<VolumeHandle>,
        Ready<u32>,
        Ready<u32>,
    ) {
        let gate = gate_of_two();
        let (burster, victim) = (volume(1), volume(2));
        let a1 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 1)).expect("room");
        let a2 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 2)).expect("room");
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 3)).is_none());
        (gate, burster, victim, a1, a2)
    }

    /// Passes one request through the gate; returns it if it may run now.
    fn admit_one(gate: &BurstGate<u32>, item: Ready<u32>) -> Option<Ready<u32>> {
        let mut ready = vec![item];
        gate.admit(&mut ready, 0);
        ready.pop()
    }

    #[test]
    fn a_bursting_volume_takes_the_gate_for_its_baseline_requests_too() {
        let (gate, burster, victim, a1, a2) = gate_full_of_burst_work();
        // The burster is bursting: its baseline request waits too, in its own queue.
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 4)).is_none());
        // A volume within its baseline passes the full gate.
        let v = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 5)).expect("baseline");
        let mut released = Vec::new();
        gate.release(&a1.ticket, &mut released);
        // The burster's baseline request goes before its waiting burst request.
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&v.ticket, &mut released);
        assert_eq!(
            released.len(),
            1,
            "two bursting requests in flight: no room"
        );
        gate.release(&a2.ticket, &mut released);
        assert_eq!(
            released.iter().map(|r| r.job).collect::<Vec<_>>(),
            vec![4, 3]
        );
        for r in released.drain(..) {
            gate.release(&r.ticket, &mut Vec::new());
        }
        // No burst request left: the burster's baseline requests pass freely again.
        assert_eq!(burster.gate_burst_requests.load(Ordering::Relaxed), 0);
        let mut held = Vec::new();
        for job in 6..9 {
            let item = dispatched_in(&burster, Phase::Baseline, job);
            held.push(admit_one(&gate, item).expect("not bursting: no wait"));
        }
        assert_eq!(lock(&gate.state).protected, 3);
    }

    #[test]
    fn a_bursting_volume_stays_bursting_while_its_gated_baseline_requests_run() {
        let gate = gate_of_two();
        let burster = volume(1);
        let a1 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 1)).expect("room");
        let b2 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 2)).expect("room");
        assert_eq!(b2.ticket.gate_slot, GateSlot::Bursting);
        gate.release(&a1.ticket, &mut Vec::new());
        // Its burst request is done, but its baseline request admitted amid the burst is
        // still in flight: the next baseline request is bursting work too, and the gate
        // (one bursting request in flight of two) still has room for exactly one.
        let b3 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 3)).expect("room");
        assert_eq!(b3.ticket.gate_slot, GateSlot::Bursting);
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 4)).is_none());
        let mut released = Vec::new();
        gate.release(&b2.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&b3.ticket, &mut released);
        for r in released {
            gate.release(&r.ticket, &mut Vec::new());
        }
        // Nothing of it left at the gate: within its baseline again.
        let b5 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 5)).expect("room");
        assert_eq!(b5.ticket.gate_slot, GateSlot::Protected);
    }

    #[test]
    fn baseline_work_in_flight_holds_burst_work_back_from_the_last_channel() {
        // Limit 2: a device of three channels, two of which burst work may take.
        let (gate, burster, victim, a1, a2) = gate_full_of_burst_work();
        let v1 = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 10)).expect("baseline");
        // Two bursting + one baseline in flight: the third channel is the victim's. A burst
        // completion lets the waiting burst request take its channel.
        let mut released = Vec::new();
        gate.release(&a1.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![3]);
        // A second baseline request passes a full device (it waits there for a completion,
        // not behind burst work).
        let v2 = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 11)).expect("baseline");
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 4)).is_none());
        // With two baseline requests in flight, one burst completion frees no channel for
        // burst work: one bursting + two baseline fill the three channels.
        let mut released = Vec::new();
        gate.release(&a2.ticket, &mut released);
        assert!(
            released.is_empty(),
            "burst work would make the device queue"
        );
        gate.release(&v1.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&v2.ticket, &mut Vec::new());
        let state = lock(&gate.state);
        assert_eq!((state.bursting, state.protected), (2, 0));
    }
}
