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
//! Bounds: the scheduler holds only requests that their sessions already hold in-flight permits
//! for, so a throttled volume fills its own connection's budget and its reader stops reading
//! the socket; nothing here grows without a bound.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};

use headroom_qos::model::is_sequential;
use headroom_qos::{
    CostModel, Decision, IoRequest, Observed, OpKind, Phase, Policy, VolumeId, VolumeQos,
    build_policy,
};

use crate::clock::Clock;
use crate::config::{DispatchMode, QosConfig};

/// What the scheduler needs to know of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    pub op: OpKind,
    pub offset_bytes: u64,
    pub len_bytes: u32,
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
    wakeups: Arc<Wakeups>,
    runner: Arc<dyn Runner<J>>,
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
    #[error("volume id {0} does not fit the scheduler's 32-bit volume ids")]
    VolumeIdTooLarge(u64),
    #[error("starting the wake-up thread: {0}")]
    Thread(std::io::Error),
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a worker lock cannot leave a policy half-updated in a way that is
    // worse than stopping service: keep serving with what is there.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<J: Send + 'static> Scheduler<J> {
    /// Builds the workers and starts the wake-up thread.
    pub fn start(
        config: &QosConfig,
        clock: Clock,
        runner: Arc<dyn Runner<J>>,
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
            wakeups: Arc::clone(&wakeups),
            runner,
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

    /// The share of a volume's QoS one worker enforces, and on which workers.
    fn shares(&self, home: usize, qos: &VolumeQos) -> Vec<(usize, VolumeQos)> {
        let n = self.workers.len();
        match self.dispatch {
            DispatchMode::OneToOne => vec![(home, *qos)],
            DispatchMode::OneToN | DispatchMode::Stealing => {
                let share = qos.scaled(1, n as u64);
                (0..n).map(|w| (w, share)).collect()
            }
        }
    }

    /// Registers a volume (or changes its QoS if it is known) and returns its handle.
    pub fn add_volume(
        &self,
        key: u64,
        qos: &VolumeQos,
    ) -> Result<Arc<VolumeHandle>, SchedulerError> {
        if let Some(handle) = self.handle(key) {
            self.update_qos(&handle, qos);
            return Ok(handle);
        }
        let id = VolumeId::try_from(key).map_err(|_| SchedulerError::VolumeIdTooLarge(key))?;
        let handle = Arc::new(VolumeHandle {
            key,
            id,
            home_worker: (key % self.workers.len() as u64) as usize,
            last_end_bytes: AtomicU64::new(u64::MAX / 2),
            spray: AtomicUsize::new(0),
            counters: PhaseCounters::default(),
            qos: Mutex::new(*qos),
        });
        let now = self.clock.now_ns();
        for (w, share) in self.shares(handle.home_worker, qos) {
            lock(&self.workers[w].state)
                .policy
                .add_volume(now, id, &share);
        }
        let mut volumes = self.volumes.write().unwrap_or_else(|p| p.into_inner());
        Ok(Arc::clone(volumes.entry(key).or_insert(handle)))
    }

    /// The handle of a registered volume.
    pub fn handle(&self, key: u64) -> Option<Arc<VolumeHandle>> {
        self.volumes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned()
    }

    /// Changes a volume's QoS live: the policies keep its credit balance (clamped to a smaller
    /// bucket) and never refill it, and queued requests are judged by the new QoS at once.
    pub fn update_qos(&self, handle: &Arc<VolumeHandle>, qos: &VolumeQos) {
        *lock(&handle.qos) = *qos;
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        for (w, share) in self.shares(handle.home_worker, qos) {
            let mut state = lock(&self.workers[w].state);
            state.policy.update_qos(now, handle.id, &share);
            self.drain(w, &mut state, now, &mut ready);
        }
        self.run_elsewhere(ready);
    }

    /// Removes a volume; its queued requests are handed to the runner, which fails them (the
    /// volume is gone from the store by then).
    pub fn remove_volume(&self, key: u64) {
        let Some(handle) = self
            .volumes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
        else {
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
        for worker in &self.workers {
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
        let cost = state.cost_model.estimate(io.op, io.len_bytes, sequential);
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
        self.drain(w, &mut state, now, ready);
        // The request is now either dispatched (in `ready`) or held back by the policy.
        if let Some(p) = state.pending.get_mut(&id) {
            p.own_drain = false;
        }
    }

    /// Reports a completed request; appends requests that may run now to `ready`.
    pub fn complete(&self, ticket: Ticket, ready: &mut Vec<Ready<J>>) {
        let now = self.clock.now_ns();
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
            self.drain(ticket.worker, &mut state, now, ready);
        }
    }

    /// Asks the policy for everything that may run now; arms the wake-up for the rest.
    fn drain(&self, w: usize, state: &mut WorkerState<J>, now: u64, ready: &mut Vec<Ready<J>>) {
        loop {
            match state.policy.next(now) {
                Decision::Dispatch(request, phase) => {
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
                            volume: p.volume,
                        },
                    });
                }
                Decision::WaitUntil(at_ns) => {
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
