//! The simulated storage node: tenants, workers running the shipped policies, NIC and devices.
//!
//! Path of one I/O (docs/design.md, "Data flow"): a tenant's generator issues it on one of its
//! submission queues; the dispatch mode picks a worker; the worker's `qos::CostModel`
//! estimates its cost vector and the worker's `qos::Policy` queues it. Whenever a worker's CPU
//! is free it asks its policy `next(now)`: a dispatched I/O occupies the CPU for its (true) CPU
//! time, then crosses the NIC (writes on ingress, reads on egress) and the backend devices, and
//! completes; `Policy::complete` and the tenant's generator hear about it at that instant.
//!
//! NIC and devices are FIFO servers fed in time order (an I/O enters them when its CPU stage
//! ends, and those events are processed in time order), so their finish times are computed on
//! entry and each I/O costs exactly two events (CPU done, completion) plus one arrival event
//! for open-loop tenants. No per-event allocation: requests live in a slab recycled through a
//! free list, and the event heap and rings keep their storage.
//!
//! This file holds the node's state and its event handlers (the I/O path above). Building a
//! node from a scenario is in `build`; mirror rebuilds of replaced volumes, their
//! bookkeeping and their handlers, are in `rebuild`.

mod build;
mod rebuild;

use crate::device::Device;
use crate::error::SimError;
use crate::event_queue::EventQueue;
use crate::histogram::Histogram;
use crate::link::Link;
use crate::rng::SimRng;
use crate::scenario::{DispatchMode, InvariantMode, ReadRouting, RebuildSpec, ScenarioSpec};
use crate::trace::TraceRecord;
use crate::worker_cpu::CpuSpec;
use crate::workload::{Mode, Schedule, SizeMix};
use headroom_qos::routing::{ReplicaLoad, route_read};
use headroom_qos::{
    BurstMode, CostModel, CostVector, Decision, IoRequest, Observed, OpKind, Phase, Policy,
    PolicyKind, VolumeId, VolumeQos,
};
use rebuild::{RebuildStats, Rebuilds};
use std::collections::VecDeque;
use std::str::FromStr;

const NS_PER_S_F: f64 = 1e9;
const NONE: u32 = u32::MAX;
/// Open-loop requests waiting for a free queue slot are capped, so that an overloaded tenant
/// cannot grow memory without bound; arrivals beyond it are counted as dropped.
const MAX_BACKLOG: u32 = 1 << 20;

/// Which scheduler the workers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyChoice {
    /// A shipped `headroom-qos` policy.
    Qos(PolicyKind),
    /// No scheduler (see [`crate::fifo`]).
    Fifo,
}

impl PolicyChoice {
    /// Parses `wild`, `base`, `credit`, `burst`, `mclock`, `drr-vop` or `fifo`.
    pub fn parse(name: &str) -> Result<PolicyChoice, SimError> {
        if name.trim().eq_ignore_ascii_case("fifo") {
            return Ok(PolicyChoice::Fifo);
        }
        PolicyKind::from_str(name)
            .map(PolicyChoice::Qos)
            .map_err(|_| SimError::UnknownPolicy(name.to_string()))
    }

    /// Stable name.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyChoice::Qos(k) => k.as_str(),
            PolicyChoice::Fifo => "fifo",
        }
    }
}

#[derive(Clone, Copy, Debug)]
/// Kept to 8 bytes (generations are `u16`: a stale event whose generation wrapped around only
/// causes one harmless extra call to `next`/`issue` checks). `Release`: a rebuild's
/// `overlap_s` has passed, or its copy is done; release its old volume if nothing uses it.
enum Ev {
    Arrival { tenant: u32, generation: u16 },
    Toggle { tenant: u32 },
    CpuDone { worker: u16, slot: u32 },
    StealDone { worker: u16 },
    Complete { slot: u32 },
    Wake { worker: u16, generation: u16 },
    Action { index: u32 },
    Check,
    Release { rebuild: u32 },
}

struct Worker {
    policy: Box<dyn Policy>,
    cost_model: CostModel,
    busy: bool,
    /// The policy's last `next` answered `Idle` (it holds no request) and nothing was
    /// enqueued since: polling it again cannot dispatch, so `kick` skips it. Only a new
    /// request can change the answer (`complete` and QoS changes cannot add one).
    idle: bool,
    wake_at_ns: u64,
    wake_generation: u16,
    ring: VecDeque<u32>,
    ops: u64,
    busy_ns: u64,
    steals: u64,
    stolen: u64,
    waits: u64,
    idles: u64,
    past_waits: u64,
}

/// A tenant's generator and counters. Laid out by temperature (`repr(C)`): the first two
/// cache lines hold everything an issue touches (the random stream included; the end of a CPU
/// stage needs only the first), the third the completion counters, then what only setup,
/// toggles and traces use. With 1,000 tenants these lines are what stays in cache.
#[repr(C, align(64))]
struct Tenant {
    // line 1: issue, completion, CPU done
    volume: VolumeId,
    group: u32,
    global_index: u32,
    qd: u32,
    outstanding: u32,
    queues: u32,
    spray: u32,
    mode: Mode,
    on: bool,
    sequential: bool,
    uniform_gaps: bool,
    read_fraction: f64,
    region_base_bytes: u64,
    last_end_bytes: u64,
    volume_bytes: u64,
    // line 2: issue, open-loop arrival
    rng: SimRng,
    cursor_bytes: u64,
    issued: u64,
    gap_mean_ns: f64,
    backlog: u32,
    arrival_generation: u16,
    // line 3: completion (inside the group's statistics window)
    ops: u64,
    bytes: u64,
    lat_sum_ns: u64,
    device_ns: f64,
    // cold
    hot_share: f64,
    trace_speed: f64,
    dropped: u64,
    /// Next trace record to arrive.
    trace_arrive: usize,
    /// Next trace record to issue (records in between are the backlog).
    trace_issue: usize,
    schedule: Schedule,
    trace: Vec<TraceRecord>,
}

const _: () =
    assert!(std::mem::offset_of!(Tenant, rng) == 64 && std::mem::offset_of!(Tenant, ops) == 128);

/// Throughput and latency of one group in one timeline bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimelineBucket {
    /// I/Os completed.
    pub ops: u64,
    /// Payload bytes completed.
    pub bytes: u64,
    /// Sum of their latencies, ns.
    pub lat_sum_ns: u64,
}

pub(crate) struct GroupRun {
    pub name: String,
    sizes: SizeMix,
    pub from_ns: u64,
    pub to_ns: u64,
    pub hist: Histogram,
    pub ops: u64,
    pub bytes: u64,
    pub phase_ops: [u64; 3],
    pub timeline: Vec<TimelineBucket>,
    /// Sum of time spent queued in the policy (issue to dispatch), ns.
    pub sched_wait_ns: u64,
    /// Sum of time spent queued after dispatch (NIC and device queues), ns.
    pub downstream_wait_ns: u64,
    /// Volumes created over the run (initial ones included).
    pub volumes_created: u64,
    /// Provisioned capacity over the whole run, GiB × seconds (what a cloud bills).
    pub provisioned_gib_s: f64,
    /// Mirror rebuilds of replaced volumes (`None` when no action rebuilds this group).
    pub rebuild: Option<RebuildStats>,
}

/// A request's shape, as the tenant or a rebuild asks for it.
#[derive(Clone, Copy)]
struct Io {
    op: OpKind,
    offset_bytes: u64,
    len_bytes: u32,
    sequential: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Ring,
    Queued,
    Running,
}

/// One request in flight. Exactly two cache lines (a completion touches most of it, about
/// 100 µs after its last use, so it is usually a cache miss): the issue time is
/// `req.arrival_ns`, and a free slot links to the next free one through `tenant`.
#[repr(align(64))]
struct Slot {
    req: IoRequest,
    /// Owning tenant; the next free slot while `state == Free`.
    tenant: u32,
    worker: u32,
    dispatch_ns: u64,
    service_ns: u64,
    wait_ns: u64,
    backend_wait_ns: u64,
    device_cost_ns: f64,
    phase: Phase,
    sequential: bool,
    state: SlotState,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 128);

/// Per-tenant outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSummary {
    /// Group index.
    pub group: usize,
    /// I/Os completed in the group's window.
    pub ops: u64,
    /// Bytes completed in the window.
    pub bytes: u64,
    /// Mean latency, µs.
    pub lat_mean_us: f64,
    /// I/Os issued over the whole run.
    pub issued: u64,
    /// Open-loop arrivals dropped because the backlog was full.
    pub dropped: u64,
    /// Device time its completed I/Os used (in the window), ns.
    pub device_ns: f64,
}

/// Per-worker outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSummary {
    /// I/Os it executed after warm-up.
    pub ops: u64,
    /// Fraction of the run its CPU was busy.
    pub busy_fraction: f64,
    /// Steal operations it made.
    pub steals: u64,
    /// Requests it stole.
    pub stolen: u64,
    /// `next` answers: wait, idle, and waits for a time not after now.
    pub decisions: [u64; 3],
}

/// Everything one policy run produced.
pub(crate) struct RunData {
    pub groups: Vec<GroupRun>,
    pub tenants: Vec<TenantSummary>,
    pub workers: Vec<WorkerSummary>,
    pub phase_timeline: Vec<[u64; 3]>,
    pub timeline_ns: u64,
    pub events: u64,
    pub completed: u64,
    pub duration_ns: u64,
    pub warmup_ns: u64,
    pub ingress_utilisation: f64,
    pub egress_utilisation: f64,
    pub device_utilisation: f64,
    pub violations: u64,
    pub first_violation: Option<String>,
}

/// Division by a run constant, as a shift and a mask when it is a power of two (stripe size
/// and device sets usually are; a 64-bit `div` per I/O is measurable).
#[derive(Clone, Copy)]
struct Divisor {
    d: u64,
    /// `log2(d)` when `d` is a power of two.
    shift: Option<u32>,
}

impl Divisor {
    fn new(d: u64) -> Divisor {
        let d = d.max(1);
        Divisor {
            d,
            shift: d.is_power_of_two().then(|| d.trailing_zeros()),
        }
    }

    /// `(x / d, x % d)`.
    #[inline]
    fn div_rem(self, x: u64) -> (u64, u64) {
        match self.shift {
            Some(s) => (x >> s, x & (self.d - 1)),
            None => (x / self.d, x % self.d),
        }
    }
}

fn secs_to_ns(secs: f64) -> u64 {
    (secs * NS_PER_S_F).round().max(0.0) as u64
}

fn f64_to_cap(v: f64) -> u64 {
    if v.is_finite() && v > 0.0 && v < u64::MAX as f64 {
        v.round() as u64
    } else {
        u64::MAX
    }
}

/// The node being simulated under one policy.
pub(crate) struct Node<'a> {
    spec: &'a ScenarioSpec,
    seed: u64,
    policy_name: &'static str,
    q: EventQueue<Ev>,
    workers: Vec<Worker>,
    tenants: Vec<Tenant>,
    groups: Vec<GroupRun>,
    group_qos: Vec<VolumeQos>,
    slots: Vec<Slot>,
    free_head: u32,
    ingress: Link,
    egress: Link,
    devices: Vec<Device>,
    /// Number of replica sets and `stripe_bytes`, as divisors (shifts when they are powers
    /// of two).
    sets_div: Divisor,
    stripe_div: Divisor,
    replicas: usize,
    read_routing: ReadRouting,
    /// Scratch for the read router (one entry per replica), reused across reads.
    replica_loads: Vec<ReplicaLoad>,
    stripe_bytes: u64,
    cpu: CpuSpec,
    node_rng: SimRng,
    dispatch: DispatchMode,
    timeline_ns: u64,
    /// Timeline bucket of the last completion and where it ends (completions come in time
    /// order, so the division is done once per bucket, not per I/O).
    timeline_bucket: usize,
    timeline_bucket_end_ns: u64,
    phase_timeline: Vec<[u64; 3]>,
    end_ns: u64,
    warmup_ns: u64,
    completed: u64,
    violations: u64,
    first_violation: Option<String>,
    next_volume: VolumeId,
    /// Some action rebuilds volumes: slots carry a `rebuild::Role` and completions look at it.
    rebuild_enabled: bool,
    /// Rebuild state, behind one pointer so that it does not spread the hot fields.
    rb: Box<Rebuilds>,
}

impl<'a> Node<'a> {
    /// Worker that owns queue `queue` of tenant `t` under pinned dispatch.
    fn home_worker(&self, t: &Tenant, queue: u32) -> usize {
        ((u64::from(t.global_index) * u64::from(t.queues) + u64::from(queue))
            % self.workers.len() as u64) as usize
    }

    /// `(worker, share numerator, share denominator)` of a tenant's QoS per worker.
    fn shares(&self, ti: usize) -> Vec<(usize, u64, u64)> {
        let n = self.workers.len();
        let t = &self.tenants[ti];
        match self.dispatch {
            DispatchMode::OneToN => (0..n).map(|w| (w, 1, n as u64)).collect(),
            DispatchMode::OneToOne | DispatchMode::Stealing => {
                let mut counts = vec![0u64; n];
                for qi in 0..t.queues {
                    counts[self.home_worker(t, qi)] += 1;
                }
                counts
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| **c > 0)
                    .map(|(w, c)| (w, *c, u64::from(t.queues)))
                    .collect()
            }
        }
    }

    fn register_volumes(&mut self, now_ns: u64) {
        for ti in 0..self.tenants.len() {
            let qos = self.group_qos[self.tenants[ti].group as usize];
            let vol = self.tenants[ti].volume;
            for (w, num, den) in self.shares(ti) {
                let share = qos.scaled(num, den);
                self.workers[w].policy.add_volume(now_ns, vol, &share);
            }
        }
    }

    fn update_group_qos(&mut self, now_ns: u64, group: usize, qos: VolumeQos) {
        self.group_qos[group] = qos;
        for ti in 0..self.tenants.len() {
            if self.tenants[ti].group as usize != group {
                continue;
            }
            let vol = self.tenants[ti].volume;
            for (w, num, den) in self.shares(ti) {
                let share = qos.scaled(num, den);
                self.workers[w].policy.update_qos(now_ns, vol, &share);
            }
        }
        for w in 0..self.workers.len() {
            self.kick(w, now_ns);
        }
    }

    fn alloc_slot(&mut self) -> u32 {
        if self.free_head != NONE {
            let i = self.free_head;
            self.free_head = self.slots[i as usize].tenant;
            return i;
        }
        let i = self.slots.len() as u32;
        self.slots.push(Slot {
            req: IoRequest {
                id: u64::from(i),
                volume: 0,
                op: OpKind::Read,
                offset_bytes: 0,
                len_bytes: 0,
                cost: CostVector::ZERO,
                arrival_ns: 0,
            },
            tenant: 0,
            worker: 0,
            dispatch_ns: 0,
            service_ns: 0,
            wait_ns: 0,
            backend_wait_ns: 0,
            device_cost_ns: 0.0,
            phase: Phase::Baseline,
            sequential: false,
            state: SlotState::Free,
        });
        i
    }

    fn free_slot(&mut self, i: u32) {
        let s = &mut self.slots[i as usize];
        s.state = SlotState::Free;
        s.tenant = self.free_head;
        self.free_head = i;
    }

    /// Runs the simulation to the end.
    pub(crate) fn run(mut self, progress: &mut dyn FnMut(f64)) -> Result<RunData, SimError> {
        for ti in 0..self.tenants.len() {
            self.q.push(0, Ev::Toggle { tenant: ti as u32 });
        }
        for (i, a) in self.spec.actions.iter().enumerate() {
            self.q
                .push(secs_to_ns(a.at_s), Ev::Action { index: i as u32 });
        }
        let check_ns = secs_to_ns(self.spec.check_invariants_ms / 1e3);
        if check_ns > 0 {
            self.q.push(check_ns, Ev::Check);
        }
        let mut next_progress = 1u64 << 16;
        while let Some((now_ns, ev)) = self.q.pop() {
            if now_ns >= self.end_ns {
                break;
            }
            match ev {
                Ev::Arrival { tenant, generation } => {
                    self.on_arrival(tenant as usize, generation, now_ns)
                }
                Ev::Toggle { tenant } => self.on_toggle(tenant as usize, now_ns),
                Ev::CpuDone { worker, slot } => self.on_cpu_done(worker as usize, slot, now_ns),
                Ev::StealDone { worker } => {
                    self.workers[worker as usize].busy = false;
                    self.kick(worker as usize, now_ns);
                }
                Ev::Complete { slot } => self.on_complete(slot, now_ns),
                Ev::Wake { worker, generation } => {
                    let w = &mut self.workers[worker as usize];
                    if w.wake_generation == generation {
                        w.wake_at_ns = u64::MAX;
                        self.kick(worker as usize, now_ns);
                    }
                }
                Ev::Action { index } => self.on_action(index as usize, now_ns)?,
                Ev::Check => {
                    self.check(now_ns)?;
                    self.q.push(now_ns + check_ns, Ev::Check);
                }
                Ev::Release { rebuild } => self.on_release(rebuild as usize, now_ns),
            }
            if self.q.processed() >= next_progress {
                next_progress += 1 << 16;
                progress(now_ns as f64 / self.end_ns as f64);
            }
        }
        self.check(self.end_ns)?;
        progress(1.0);
        Ok(self.finish())
    }

    fn check(&mut self, now_ns: u64) -> Result<(), SimError> {
        for (i, w) in self.workers.iter().enumerate() {
            if let Err(v) = w.policy.check_invariants() {
                if self.spec.invariants == InvariantMode::Fail {
                    return Err(SimError::Invariant {
                        policy: self.policy_name.to_string(),
                        at_ns: now_ns,
                        seed: self.seed,
                        detail: format!("worker {i}: {v}"),
                    });
                }
                self.violations += 1;
                if self.first_violation.is_none() {
                    self.first_violation = Some(format!("t={now_ns} ns worker {i}: {v}"));
                }
            }
        }
        Ok(())
    }

    fn on_action(&mut self, index: usize, now_ns: u64) -> Result<(), SimError> {
        let a = &self.spec.actions[index];
        let Some(group) = self.spec.groups.iter().position(|g| g.name == a.group) else {
            return Err(SimError::Invalid(format!("unknown group {}", a.group)));
        };
        if let Some(q) = &a.set_qos {
            let qos = q.to_volume_qos(self.spec.groups[group].volume_bytes())?;
            self.update_group_qos(now_ns, group, qos);
        }
        if a.replace_volumes {
            self.replace_volumes(now_ns, group, a.start_full, a.overlap_s, a.rebuild);
        }
        if a.every_s > 0.0 {
            self.q.push(
                now_ns + secs_to_ns(a.every_s),
                Ev::Action {
                    index: index as u32,
                },
            );
        }
        Ok(())
    }

    /// Moves every tenant of `group` to a fresh volume. Without `rebuild`, queued requests
    /// follow it and the old volume is dropped at once (billed `overlap_s` more); with it, the
    /// old volume stays until its copy onto the new one is done (see [`Node::start_rebuild`]).
    fn replace_volumes(
        &mut self,
        now_ns: u64,
        group: usize,
        start_full: Option<bool>,
        overlap_s: f64,
        rebuild: Option<RebuildSpec>,
    ) {
        let mut qos = self.group_qos[group];
        if let (Some(full), BurstMode::Credits(mut c)) = (start_full, qos.burst) {
            for b in [&mut c.iops, &mut c.bytes].into_iter().flatten() {
                b.start_full = full;
            }
            qos.burst = BurstMode::Credits(c);
        }
        let gib = self.spec.groups[group].volume_gib;
        for ti in 0..self.tenants.len() {
            if self.tenants[ti].group as usize != group {
                continue;
            }
            if let Some(spec) = &rebuild {
                self.start_rebuild(now_ns, ti, &qos, spec, overlap_s);
                continue;
            }
            if self.rebuild_enabled && self.skip_while_rebuilding(ti) {
                // A rebuild still needs the tenant's current volume (another action's).
                continue;
            }
            let old = self.tenants[ti].volume;
            let new = self.next_volume;
            self.next_volume += 1;
            // Requests the policies still hold for the old volume, in issue order.
            let mut moved: Vec<u32> = (0..self.slots.len() as u32)
                .filter(|&i| {
                    let s = &self.slots[i as usize];
                    s.tenant as usize == ti
                        && matches!(s.state, SlotState::Queued | SlotState::Ring)
                })
                .collect();
            moved.sort_by_key(|&i| (self.slots[i as usize].req.arrival_ns, i));
            for (w, num, den) in self.shares(ti) {
                let share = qos.scaled(num, den);
                let p = &mut self.workers[w].policy;
                p.add_volume(now_ns, new, &share);
                p.remove_volume(now_ns, old);
            }
            self.tenants[ti].volume = new;
            for i in moved {
                let s = &mut self.slots[i as usize];
                s.req.volume = new;
                if s.state == SlotState::Queued {
                    let w = s.worker as usize;
                    let req = s.req.clone();
                    let wk = &mut self.workers[w];
                    wk.idle = false;
                    wk.policy.enqueue(now_ns, req);
                }
            }
            let g = &mut self.groups[group];
            g.volumes_created += 1;
            g.provisioned_gib_s += gib * overlap_s;
        }
        for w in 0..self.workers.len() {
            self.kick(w, now_ns);
        }
    }

    fn on_toggle(&mut self, ti: usize, now_ns: u64) {
        let was_on = self.tenants[ti].on;
        let on = self.tenants[ti].schedule.is_on(now_ns);
        self.tenants[ti].on = on;
        if on && !was_on {
            match self.tenants[ti].mode {
                Mode::Closed => {
                    while self.tenants[ti].outstanding < self.tenants[ti].qd {
                        if self.issue(ti, now_ns).is_none() {
                            break;
                        }
                    }
                }
                Mode::Open => {
                    let t = &mut self.tenants[ti];
                    t.arrival_generation = t.arrival_generation.wrapping_add(1);
                    let gap = Self::gap_ns(t);
                    if let Some(gap) = gap {
                        let generation = t.arrival_generation;
                        self.q.push(
                            now_ns + gap,
                            Ev::Arrival {
                                tenant: ti as u32,
                                generation,
                            },
                        );
                    }
                }
                Mode::Trace => {
                    let t = &mut self.tenants[ti];
                    t.arrival_generation = t.arrival_generation.wrapping_add(1);
                    if let Some(at) = Self::trace_time_ns(t) {
                        let generation = t.arrival_generation;
                        self.q.push(
                            at.max(now_ns),
                            Ev::Arrival {
                                tenant: ti as u32,
                                generation,
                            },
                        );
                    }
                }
                Mode::Idle => {}
            }
        } else if !on && was_on {
            let t = &mut self.tenants[ti];
            t.arrival_generation = t.arrival_generation.wrapping_add(1);
        }
        if let Some(next) = self.tenants[ti].schedule.next_change_ns(now_ns) {
            self.q.push(next, Ev::Toggle { tenant: ti as u32 });
        }
    }

    #[inline]
    fn gap_ns(t: &mut Tenant) -> Option<u64> {
        if !t.gap_mean_ns.is_finite() {
            return None;
        }
        let g = if t.uniform_gaps {
            t.gap_mean_ns
        } else {
            t.rng.exp(t.gap_mean_ns)
        };
        Some(crate::fastmath::round_u64(g).max(1))
    }

    /// When the tenant's next trace record arrives (its recorded time over the replay speed).
    fn trace_time_ns(t: &Tenant) -> Option<u64> {
        t.trace
            .get(t.trace_arrive)
            .map(|r| (r.at_ns as f64 / t.trace_speed) as u64)
    }

    fn on_arrival(&mut self, ti: usize, generation: u16, now_ns: u64) {
        let t = &mut self.tenants[ti];
        if t.arrival_generation != generation || !t.on {
            return;
        }
        let can_issue = t.qd == 0 || t.outstanding < t.qd;
        let next = match t.mode {
            Mode::Trace => {
                t.trace_arrive += 1;
                Self::trace_time_ns(t).map(|at| at.max(now_ns))
            }
            _ => Self::gap_ns(t).map(|g| now_ns + g),
        };
        if !can_issue {
            if t.backlog < MAX_BACKLOG {
                t.backlog += 1;
            } else {
                // Drop the oldest waiting request; the new one takes its place.
                t.dropped += 1;
                if t.mode == Mode::Trace {
                    t.trace_issue += 1;
                }
            }
        }
        if can_issue {
            self.issue(ti, now_ns);
        }
        if let Some(at) = next {
            self.q.push(
                at,
                Ev::Arrival {
                    tenant: ti as u32,
                    generation,
                },
            );
        }
    }

    /// Draws the tenant's next request and hands it to a worker; returns the worker it
    /// was handed to (and which was kicked), or `None` when the tenant had nothing to issue.
    fn issue(&mut self, ti: usize, now_ns: u64) -> Option<usize> {
        let nworkers = self.workers.len();
        let (op, offset, len, queue, sequential) = {
            let t = &mut self.tenants[ti];
            let g = &self.groups[t.group as usize];
            let (op, offset, len) = if t.mode == Mode::Trace {
                match t.trace.get(t.trace_issue) {
                    Some(r) => {
                        t.trace_issue += 1;
                        (r.op, r.offset_bytes % t.volume_bytes.max(1), r.len_bytes)
                    }
                    None => return None,
                }
            } else {
                let len = g.sizes.sample(&mut t.rng);
                let op = if t.read_fraction >= 1.0
                    || (t.read_fraction > 0.0 && t.rng.unit() < t.read_fraction)
                {
                    OpKind::Read
                } else {
                    OpKind::Write
                };
                let len64 = u64::from(len);
                let offset = if t.sequential {
                    if t.cursor_bytes + len64 > t.volume_bytes {
                        t.cursor_bytes = 0;
                    }
                    let o = t.cursor_bytes;
                    t.cursor_bytes += len64;
                    o
                } else {
                    let pages = (t.volume_bytes.saturating_sub(len64) / 4096).max(1);
                    t.rng.below(pages) * 4096
                };
                (op, offset, len)
            };
            let sequential = headroom_qos::model::is_sequential(t.last_end_bytes, offset);
            t.last_end_bytes = offset + u64::from(len);
            let queue = if t.queues <= 1 {
                0
            } else if t.hot_share > 0.0 {
                if t.rng.chance(t.hot_share) {
                    0
                } else {
                    1 + t.rng.below(u64::from(t.queues - 1)) as u32
                }
            } else {
                t.rng.below(u64::from(t.queues)) as u32
            };
            t.outstanding += 1;
            t.issued += 1;
            (op, offset, len, queue, sequential)
        };
        let worker = match self.dispatch {
            DispatchMode::OneToN => {
                let t = &mut self.tenants[ti];
                let w = t.spray as usize % nworkers;
                t.spray = t.spray.wrapping_add(1);
                w
            }
            DispatchMode::OneToOne | DispatchMode::Stealing => {
                self.home_worker(&self.tenants[ti], queue)
            }
        };
        let volume = self.tenants[ti].volume;
        let io = Io {
            op,
            offset_bytes: offset,
            len_bytes: len,
            sequential,
        };
        if self.rebuild_enabled {
            self.submit_tenant_during_rebuilds(ti, worker, volume, io, now_ns);
        } else {
            self.submit(ti, worker, volume, io, now_ns);
        }
        Some(worker)
    }

    /// Hands one request to `worker`'s policy (or ring) and lets the worker dispatch; returns
    /// the request's slot.
    #[inline(always)]
    fn submit(&mut self, ti: usize, worker: usize, volume: VolumeId, io: Io, now_ns: u64) -> u32 {
        let Io {
            op,
            offset_bytes: offset,
            len_bytes: len,
            sequential,
        } = io;
        let nworkers = self.workers.len();
        let cost = self.workers[worker]
            .cost_model
            .estimate(op, len, sequential);
        let slot = self.alloc_slot();
        let stealing = self.dispatch == DispatchMode::Stealing;
        {
            // Field by field from registers: copying a request built on the stack reads it
            // back in 16-byte pieces that straddle its 8-byte stores, which stalls (store
            // forwarding fails), and so does reading the slot's copy right after writing it.
            let s = &mut self.slots[slot as usize];
            let r = &mut s.req;
            r.id = u64::from(slot);
            r.volume = volume;
            r.op = op;
            r.offset_bytes = offset;
            r.len_bytes = len;
            r.cost = cost;
            r.arrival_ns = now_ns;
            s.tenant = ti as u32;
            s.worker = worker as u32;
            s.sequential = sequential;
            s.service_ns = 0;
            s.wait_ns = 0;
            s.backend_wait_ns = 0;
            s.state = if stealing {
                SlotState::Ring
            } else {
                SlotState::Queued
            };
        }
        if stealing {
            self.workers[worker].ring.push_back(slot);
            if self.workers[worker].busy {
                // A polling idle worker notices the backlog and steals.
                if let Some(idle) = (0..nworkers).find(|w| !self.workers[*w].busy) {
                    self.kick(idle, now_ns);
                }
            }
        } else {
            let wk = &mut self.workers[worker];
            wk.idle = false;
            wk.policy.enqueue(
                now_ns,
                IoRequest {
                    id: u64::from(slot),
                    volume,
                    op,
                    offset_bytes: offset,
                    len_bytes: len,
                    cost,
                    arrival_ns: now_ns,
                },
            );
        }
        self.kick(worker, now_ns);
        slot
    }

    /// Lets worker `w` dispatch if its CPU is free.
    fn kick(&mut self, w: usize, now_ns: u64) {
        let wk = &self.workers[w];
        if wk.busy || wk.idle {
            return;
        }
        loop {
            if self.dispatch == DispatchMode::Stealing {
                self.refill_from_ring(w, now_ns);
            }
            match self.workers[w].policy.next(now_ns) {
                Decision::Dispatch(req, phase) => {
                    self.start(w, req, phase, now_ns);
                    return;
                }
                Decision::WaitUntil(until_ns) => {
                    let wk = &mut self.workers[w];
                    wk.waits += 1;
                    if until_ns <= now_ns {
                        wk.past_waits += 1;
                    }
                    let at_ns = until_ns.max(now_ns + 1);
                    if at_ns < wk.wake_at_ns {
                        wk.wake_at_ns = at_ns;
                        wk.wake_generation = wk.wake_generation.wrapping_add(1);
                        let generation = wk.wake_generation;
                        self.q.push(
                            at_ns,
                            Ev::Wake {
                                worker: w as u16,
                                generation,
                            },
                        );
                    }
                    return;
                }
                Decision::Idle => {
                    let wk = &mut self.workers[w];
                    wk.idles += 1;
                    // Under stealing, requests wait in rings outside the policy, so an idle
                    // worker is polled again to look at them.
                    wk.idle = self.dispatch != DispatchMode::Stealing;
                    if self.dispatch == DispatchMode::Stealing && !self.workers[w].ring.is_empty() {
                        continue;
                    }
                    if self.dispatch == DispatchMode::Stealing {
                        self.try_steal(w, now_ns);
                    }
                    return;
                }
            }
        }
    }

    fn refill_from_ring(&mut self, w: usize, now_ns: u64) {
        let batch = self.spec.node.steal_batch as usize;
        while self.workers[w].policy.queued_requests() < batch {
            let Some(slot) = self.workers[w].ring.pop_front() else {
                break;
            };
            let s = &mut self.slots[slot as usize];
            s.state = SlotState::Queued;
            s.worker = w as u32;
            let req = s.req.clone();
            self.workers[w].policy.enqueue(now_ns, req);
        }
    }

    /// An idle worker takes up to a batch from the longest other ring.
    fn try_steal(&mut self, w: usize, now_ns: u64) {
        let mut victim = None;
        let mut longest = 0;
        for (i, other) in self.workers.iter().enumerate() {
            if i != w && other.ring.len() > longest {
                longest = other.ring.len();
                victim = Some(i);
            }
        }
        let Some(v) = victim else {
            return;
        };
        let take = longest.div_ceil(2).min(self.spec.node.steal_batch as usize);
        for _ in 0..take {
            if let Some(slot) = self.workers[v].ring.pop_back() {
                self.workers[w].ring.push_front(slot);
            }
        }
        let cost = self.spec.node.steal_cost_ns * take as u64;
        let wk = &mut self.workers[w];
        wk.steals += 1;
        wk.stolen += take as u64;
        if cost > 0 {
            wk.busy = true;
            if now_ns >= self.warmup_ns {
                wk.busy_ns += cost;
            }
            self.q
                .push(now_ns + cost, Ev::StealDone { worker: w as u16 });
        } else {
            self.q.push(now_ns, Ev::StealDone { worker: w as u16 });
            wk.busy = true;
        }
    }

    fn start(&mut self, w: usize, req: IoRequest, phase: Phase, now_ns: u64) {
        let slot = req.id as u32;
        let mut cpu_ns = self
            .cpu
            .sample_ns(req.op, req.len_bytes, &mut self.node_rng);
        if self.dispatch == DispatchMode::Stealing {
            cpu_ns += self.spec.node.sync_overhead_ns;
        }
        let s = &mut self.slots[slot as usize];
        // The issue time lives in `req.arrival_ns`; keep ours whatever the policy hands back.
        let issue_ns = s.req.arrival_ns;
        s.req = req;
        s.req.arrival_ns = issue_ns;
        s.phase = phase;
        s.dispatch_ns = now_ns;
        s.worker = w as u32;
        s.state = SlotState::Running;
        s.service_ns = cpu_ns;
        let wk = &mut self.workers[w];
        wk.busy = true;
        if now_ns >= self.warmup_ns {
            wk.busy_ns += cpu_ns;
            wk.ops += 1;
        }
        self.q.push(
            now_ns + cpu_ns,
            Ev::CpuDone {
                worker: w as u16,
                slot,
            },
        );
    }

    fn on_cpu_done(&mut self, w: usize, slot: u32, now_ns: u64) {
        self.workers[w].busy = false;
        let (op, offset, len, ti, sequential) = {
            let s = &self.slots[slot as usize];
            (
                s.req.op,
                s.req.offset_bytes,
                s.req.len_bytes,
                s.tenant as usize,
                s.sequential,
            )
        };
        // NIC: writes arrive on ingress, reads leave on egress.
        let link_done = match op {
            OpKind::Write => self.ingress.submit(now_ns, u64::from(len)),
            OpKind::Read => self.egress.submit(now_ns, u64::from(len)),
            _ => now_ns,
        };
        let link_transfer = match op {
            OpKind::Read | OpKind::Write => self.link_time_ns(op, len),
            _ => 0,
        };
        let link_time = link_done - now_ns;
        let link_wait = link_time.saturating_sub(link_transfer);
        // Devices.
        let t = &self.tenants[ti];
        let stripe = self.stripe_bytes;
        let (extent, in_stripe) = self.stripe_div.div_rem(offset);
        let set = self.sets_div.div_rem(u64::from(t.global_index) + extent).1 as usize;
        let phys = t.region_base_bytes + self.sets_div.div_rem(extent).0 * stripe + in_stripe;
        let r = self.replicas;
        let mut done = link_done;
        let mut device_wait = 0;
        let mut device_service = 0;
        let mut device_cost = 0.0;
        let is_read = op == OpKind::Read;
        if is_read || r == 1 {
            let j = if is_read && r > 1 {
                // The server's router (FAST's default-with-steal for `TypeAware`); round robin
                // turns per tenant: tenant i reads from replica i mod r.
                self.replica_loads.clear();
                self.replica_loads
                    .extend(
                        self.devices[set * r..set * r + r]
                            .iter()
                            .map(|d| ReplicaLoad {
                                healthy: true,
                                in_flight: d.in_flight_at(link_done),
                            }),
                    );
                route_read(
                    self.read_routing,
                    sequential,
                    u64::from(t.global_index),
                    &self.replica_loads,
                )
                .unwrap_or(0)
            } else {
                0
            };
            let svc = self.devices[set * r + j].submit(link_done, op, phys, len);
            device_cost = svc.cost_ns;
            done = svc.done_ns;
            device_wait = svc.start_ns - link_done;
            device_service = svc.done_ns - svc.start_ns;
        } else {
            for j in 0..r {
                let svc = self.devices[set * r + j].submit(link_done, op, phys, len);
                device_cost += svc.cost_ns;
                if svc.done_ns >= done {
                    done = svc.done_ns;
                    device_wait = svc.start_ns - link_done;
                    device_service = svc.done_ns - svc.start_ns;
                }
            }
        }
        let s = &mut self.slots[slot as usize];
        // Front-end queueing (the NIC) is what the delay-based CPU correction watches; the
        // backend's queueing counts as service, as in BurstCBS (§1.5: backend delay excluded).
        s.service_ns += link_transfer + device_wait + device_service;
        s.wait_ns += link_wait;
        s.backend_wait_ns = device_wait;
        s.device_cost_ns = device_cost;
        self.q.push(done, Ev::Complete { slot });
        // A policy holding no request can only answer `Idle`: ask the cheap question first
        // (in open-loop runs most CPU stages end with nothing queued).
        let wk = &mut self.workers[w];
        if self.dispatch != DispatchMode::Stealing && wk.policy.queued_requests() == 0 {
            wk.idles += 1;
            wk.idle = true;
            return;
        }
        self.kick(w, now_ns);
    }

    fn link_time_ns(&self, op: OpKind, len: u32) -> u64 {
        let link = if op == OpKind::Write {
            &self.ingress
        } else {
            &self.egress
        };
        link.transfer_ns(u64::from(len))
    }

    /// A request's last stage is done: its worker's cost model and policy learn how it went,
    /// and its slot is freed.
    #[inline]
    fn retire(&mut self, w: usize, slot: u32, now_ns: u64, observed: Observed) {
        {
            let s = &self.slots[slot as usize];
            let wk = &mut self.workers[w];
            wk.cost_model.observe(
                s.req.op,
                s.req.len_bytes,
                s.sequential,
                &s.req.cost,
                observed,
            );
            wk.policy.complete(now_ns, &s.req, observed);
        }
        self.free_slot(slot);
        self.completed += 1;
    }

    fn on_complete(&mut self, slot: u32, now_ns: u64) {
        if self.rebuild_enabled && self.on_rebuild_complete(slot, now_ns) {
            return;
        }
        let (w, ti, phase, len, issue_ns, dispatch_ns, backend_wait, device_cost, observed) = {
            let s = &self.slots[slot as usize];
            (
                s.worker as usize,
                s.tenant as usize,
                s.phase,
                s.req.len_bytes,
                s.req.arrival_ns,
                s.dispatch_ns,
                s.backend_wait_ns,
                s.device_cost_ns,
                Observed {
                    service_ns: s.service_ns,
                    queue_ns: s.wait_ns,
                },
            )
        };
        self.retire(w, slot, now_ns, observed);
        let lat = now_ns - issue_ns;
        let bytes = u64::from(len);
        let t = &mut self.tenants[ti];
        let g = &mut self.groups[t.group as usize];
        if now_ns >= g.from_ns && now_ns < g.to_ns {
            g.hist.record(lat);
            g.ops += 1;
            g.bytes += bytes;
            g.phase_ops[phase as usize] += 1;
            g.sched_wait_ns += dispatch_ns - issue_ns;
            g.downstream_wait_ns += observed.queue_ns + backend_wait;
            t.ops += 1;
            t.bytes += bytes;
            t.lat_sum_ns += lat;
            t.device_ns += device_cost;
        }
        if now_ns >= self.timeline_bucket_end_ns {
            self.timeline_bucket = (now_ns / self.timeline_ns) as usize;
            self.timeline_bucket_end_ns = (now_ns / self.timeline_ns + 1) * self.timeline_ns;
        }
        let b = self.timeline_bucket;
        if let Some(tb) = g.timeline.get_mut(b) {
            tb.ops += 1;
            tb.bytes += bytes;
            tb.lat_sum_ns += lat;
        }
        if let Some(pb) = self.phase_timeline.get_mut(b) {
            pb[phase as usize] += 1;
        }
        t.outstanding -= 1;
        let reissue = t.on
            && match t.mode {
                Mode::Closed => t.outstanding < t.qd,
                Mode::Open | Mode::Trace => {
                    if t.backlog > 0 {
                        t.backlog -= 1;
                        true
                    } else {
                        false
                    }
                }
                Mode::Idle => false,
            };
        let kicked = if reissue {
            self.issue(ti, now_ns)
        } else {
            None
        };
        // `issue` already polled its worker after this completion and the new request; a
        // second poll of the same worker at the same instant would answer the same.
        if kicked != Some(w) {
            self.kick(w, now_ns);
        }
    }

    fn finish(mut self) -> RunData {
        self.bill_unreleased();
        let dur = self.end_ns.saturating_sub(self.warmup_ns).max(1) as f64;
        let tenants = self
            .tenants
            .iter()
            .map(|t| TenantSummary {
                group: t.group as usize,
                ops: t.ops,
                bytes: t.bytes,
                lat_mean_us: if t.ops > 0 {
                    t.lat_sum_ns as f64 / t.ops as f64 / 1e3
                } else {
                    0.0
                },
                issued: t.issued,
                dropped: t.dropped,
                device_ns: t.device_ns,
            })
            .collect();
        let workers = self
            .workers
            .iter()
            .map(|w| WorkerSummary {
                ops: w.ops,
                busy_fraction: w.busy_ns as f64 / dur,
                steals: w.steals,
                stolen: w.stolen,
                decisions: [w.waits, w.idles, w.past_waits],
            })
            .collect();
        let total = self.end_ns.max(1) as f64;
        let dev_busy: f64 = self.devices.iter().map(|d| d.busy_ns).sum::<f64>();
        RunData {
            groups: self.groups,
            tenants,
            workers,
            phase_timeline: self.phase_timeline,
            timeline_ns: self.timeline_ns,
            events: self.q.processed(),
            completed: self.completed,
            duration_ns: self.end_ns,
            warmup_ns: self.warmup_ns,
            ingress_utilisation: self.ingress.busy_ns / total,
            egress_utilisation: self.egress.busy_ns / total,
            device_utilisation: dev_busy / (total * self.devices.len().max(1) as f64),
            violations: self.violations,
            first_violation: self.first_violation,
        }
    }
}
