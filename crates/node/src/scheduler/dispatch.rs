//! Submission: which worker a request goes to, what it is charged, and everything the
//! policy lets run once it is queued (the drain that turns the policy's decisions into
//! [`Ready`] jobs and arms the wake-up for the rest).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use headroom_qos::model::is_sequential;
use headroom_qos::{Decision, IoRequest, OpKind, Phase};

use super::config::DispatchMode;
use super::gate::GateSlot;
use super::ticket::Ticket;
use super::volume::VolumeHandle;
use super::worker::{Pending, WorkerState};
use super::{IoDesc, MAX_CHARGED_SYNCS, Queued, Ready, Scheduler};
use crate::sync::lock;

impl<J: Send + 'static> Scheduler<J> {
    /// Picks the worker for one request of `handle`.
    pub(super) fn pick_worker(&self, handle: &VolumeHandle) -> usize {
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
        let sequential = note_end(handle, &io);
        let first = ready.len();
        let mut state = lock(&self.workers[w].state);
        let now = self.clock.now_ns();
        self.submit_locked(w, &mut state, now, handle, (io, sequential), job, ready);
        drop(state);
        self.gate.admit(ready, first);
        self.maybe_rebalance(now, ready);
    }

    /// Whether requests may be held for [`Scheduler::submit_batch`]: not under stealing
    /// dispatch, which picks each request's worker by how many requests the workers have
    /// queued, and a batch not yet submitted is queued nowhere.
    pub fn batches(&self) -> bool {
        self.dispatch != DispatchMode::Stealing
    }

    /// Adds a request of `handle` to `batch`, to be submitted with the others by
    /// [`Scheduler::submit_batch`]: its worker and whether it is sequential are decided now,
    /// in the order the requests came, as [`Scheduler::submit`] decides them.
    pub fn queue(
        &self,
        handle: &Arc<VolumeHandle>,
        io: IoDesc,
        job: J,
        batch: &mut Vec<Queued<J>>,
    ) {
        let worker = self.pick_worker(handle);
        let sequential = note_end(handle, &io);
        batch.push(Queued {
            worker,
            sequential,
            io,
            job: Some(job),
        });
    }

    /// Submits a batch of requests of `handle` (see [`Scheduler::queue`]), each as
    /// [`Scheduler::submit`] would, in their order, but with one hold of each worker's lock for
    /// the requests sent to it; appends what the policy lets run to `ready` and leaves `batch`
    /// empty. What a batch saves is the per-request glue around the policy: the lock, the
    /// burst gate's and the pool's checks. The clock is still read for each request: a policy
    /// that spaces requests by their time (mClock's tags) would hold back all but the first of
    /// a batch that arrived at one instant, for the wake-up thread to release.
    pub fn submit_batch(
        &self,
        handle: &Arc<VolumeHandle>,
        batch: &mut Vec<Queued<J>>,
        ready: &mut Vec<Ready<J>>,
    ) {
        if batch.is_empty() {
            return;
        }
        let first = ready.len();
        let mut now = 0;
        for w in 0..self.workers.len() {
            let mut state = None;
            for queued in batch.iter_mut().filter(|q| q.worker == w) {
                let Some(job) = queued.job.take() else {
                    continue;
                };
                let state = state.get_or_insert_with(|| lock(&self.workers[w].state));
                now = self.clock.now_ns();
                let io = (queued.io, queued.sequential);
                self.submit_locked(w, state, now, handle, io, job, ready);
            }
        }
        debug_assert!(
            batch.iter().all(|q| q.job.is_none()),
            "a worker out of range"
        );
        batch.clear();
        self.gate.admit(ready, first);
        self.maybe_rebalance(now, ready);
    }

    /// The part of a submission under worker `w`'s lock: the request's id and cost, the
    /// policy's `enqueue`, and the drain of what it lets run.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn submit_locked(
        &self,
        w: usize,
        state: &mut WorkerState<J>,
        now: u64,
        handle: &Arc<VolumeHandle>,
        (io, sequential): (IoDesc, bool),
        job: J,
        ready: &mut Vec<Ready<J>>,
    ) {
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
        let pending = Pending {
            job,
            volume: Arc::clone(handle),
            sequential,
            own_drain: true,
        };
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
        // The job stays in hand while the policy decides: one dispatched at once (the common
        // case) never enters the map of held jobs, and one held back enters it afterwards.
        let mut in_hand = Some((id, pending));
        self.drain_with(w, state, now, ready, &mut in_hand);
        if let Some((id, mut p)) = in_hand {
            p.own_drain = false;
            state.pending.insert(id, p);
        }
    }

    /// Asks the policy for everything that may run now; arms the wake-up for the rest.
    pub(super) fn drain(
        &self,
        w: usize,
        state: &mut WorkerState<J>,
        now: u64,
        ready: &mut Vec<Ready<J>>,
    ) {
        self.drain_with(w, state, now, ready, &mut None);
    }

    /// [`Scheduler::drain`] with the job of the request just enqueued (`in_hand`, with its
    /// request id) not yet in `pending`; taken out of `in_hand` if the policy dispatches it
    /// (by reference: the job is a few hundred bytes, moved only into `ready`).
    fn drain_with(
        &self,
        w: usize,
        state: &mut WorkerState<J>,
        now: u64,
        ready: &mut Vec<Ready<J>>,
        in_hand: &mut Option<(u64, Pending<J>)>,
    ) {
        loop {
            match state.policy.next(now) {
                Decision::Dispatch(request, phase) => {
                    state.used = state.used.saturating_add(request.cost);
                    state.dispatched_total = state.dispatched_total.saturating_add(request.cost);
                    if phase == Phase::Baseline {
                        state.used_baseline = state.used_baseline.saturating_add(request.cost);
                        state.baseline_total = state.baseline_total.saturating_add(request.cost);
                    }
                    let p = match in_hand.take_if(|(id, _)| *id == request.id) {
                        Some((_, p)) => Some(p),
                        None => state.pending.remove(&request.id),
                    };
                    let Some(p) = p else {
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
}

/// Records where `io` ends as its volume's last end; whether it starts where the one before
/// ended (the cost model's sequential case).
fn note_end(handle: &VolumeHandle, io: &IoDesc) -> bool {
    let end = io.offset_bytes.saturating_add(u64::from(io.len_bytes));
    let previous_end = handle.last_end_bytes.swap(end, Ordering::Relaxed);
    is_sequential(previous_end, io.offset_bytes)
}
