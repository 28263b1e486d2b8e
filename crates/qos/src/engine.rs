//! The ring-based scheduling engine shared by Wild, Base, Credit, Burst and DRR-VOP.
//!
//! These policies differ only in *when* a volume's head request may run and *which class* of
//! ready volumes goes first; the mechanics (queues, ready rings served round robin, timers,
//! the node pacer, live QoS changes, invariant tracking) are the same. [`Rules`] captures the
//! difference; [`Engine`] does the rest, in O(log n) per request.
//!
//! A volume with queued requests is always *placed* exactly once: at the back (or front) of
//! one ready ring, or in the timer heap at the time its head request becomes eligible. It is
//! placed again after every change that can affect it (dispatch, QoS change, a timer firing),
//! which bumps its generation and makes every older placement stale.

use crate::cost::CostVector;
use crate::error::InvariantViolation;
use crate::limiter::{Charge, Pacer};
use crate::policy::{Policy, VolumeSnapshot};
use crate::sched::{Clock, Ready, Slab, VolCore};
use crate::tracker::Tracker;
use crate::vocab::{
    Decision, IoRate, IoRequest, NodeCapacity, Observed, Phase, VolumeId, VolumeQos,
};

/// How many volumes one [`Policy::next`] call sets aside (their head request waits for the
/// pacer) looking for one that may run: bounds the call's cost with many waiting volumes.
const MAX_PASSED_OVER: usize = 64;

/// How many times one [`Policy::next`] call moves a request ahead of its volume's head.
const MAX_REORDERS: usize = 16;

/// Where a backlogged volume goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Ready now in ring `class` (lower classes are served first); optionally re-place at
    /// `reclassify_at` (e.g. when its baseline meter refills and it may move to a better class).
    Ring {
        class: usize,
        front: bool,
        reclassify_at: Option<u64>,
    },
    /// Not eligible before this time.
    At(u64),
}

/// What a rules object decides at dispatch time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Dispatch in this phase; `front` keeps the volume at the front of its ring for its next
    /// request (weighted round robin turns, DRR deficit left).
    Run { phase: Phase, front: bool },
    /// Do not dispatch now; move the volume to the back of its ring (DRR: deficit too small).
    Rotate,
}

/// The request a rules object decides on or charges, and where it comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx<'a> {
    pub(crate) now_ns: u64,
    /// Slot of the volume.
    pub(crate) idx: u32,
    /// The ring class the volume is served from now, after [`Rules::effective_class`].
    pub(crate) class: usize,
    /// The volume (for `verdict` its queue still holds the request; for `charge` not).
    pub(crate) core: &'a VolCore,
    pub(crate) charge: Charge,
    pub(crate) req: &'a IoRequest,
}

/// The policy-specific part of a ring-based policy.
pub(crate) trait Rules: Send + std::fmt::Debug {
    /// Policy-specific per-volume state.
    type Vol: Send + std::fmt::Debug;

    fn name(&self) -> &'static str;
    fn classes(&self) -> usize;
    fn new_vol(&mut self, now_ns: u64, idx: u32, qos: &VolumeQos) -> Self::Vol;
    fn reconfigure(&mut self, now_ns: u64, idx: u32, qos: &VolumeQos, vol: &mut Self::Vol);
    /// A volume was removed at `now_ns` (its state is dropped after this).
    fn removed(&mut self, _now_ns: u64, _idx: u32, _vol: &Self::Vol) {}
    /// The ceiling this policy enforces for a volume (invariant tracking).
    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate;
    /// A volume's queue went from empty to non-empty.
    fn became_backlogged(&mut self, _now_ns: u64, _idx: u32, _vol: &mut Self::Vol) {}
    /// Where the head request (`charge`, `cost`) of a backlogged volume goes.
    fn classify(
        &mut self,
        now_ns: u64,
        idx: u32,
        core: &VolCore,
        vol: &mut Self::Vol,
        charge: Charge,
        cost: &CostVector,
    ) -> Place;
    /// Whether a ring class holds baseline requests (they may run inside the node pacer's
    /// allowance, see [`crate::limiter::Pacer`]).
    fn is_baseline_class(&self, _class: usize) -> bool {
        false
    }
    /// Whether volume `idx`'s baseline requests may run inside the node pacer's allowance.
    /// Burst and Credit: not while the volume is bursting. Its baseline requests then wait for the pacer
    /// like its burst requests, so they cannot spend the allowance its neighbours' baseline
    /// requests run in, and a blocked one does not hold back the baseline class behind it.
    fn baseline_allowance(&self, _now_ns: u64, _idx: u32, _vol: &Self::Vol) -> bool {
        true
    }
    /// The class a ring-front volume really belongs to now: promotions fire up to one wheel
    /// slot late, so a volume whose baseline meter refilled is treated as baseline at once.
    fn effective_class(
        &self,
        _now_ns: u64,
        class: usize,
        _vol: &Self::Vol,
        _charge: Charge,
    ) -> usize {
        class
    }
    /// Extra node-wide gate for a class (Burst: the burst pacer). Earliest time it admits `cost`.
    fn class_gate(&self, now_ns: u64, _class: usize, _cost: &CostVector) -> u64 {
        now_ns
    }
    /// The dimensions (a bit each, [`CostVector::dims_mask`] order) in which
    /// [`Rules::class_gate`] holds back a request of `cost` in `class` at `now_ns`.
    fn class_blocking_dims(&self, _now_ns: u64, _class: usize, _cost: &CostVector) -> u8 {
        0
    }
    /// Decides on the head request of a ring's front volume. `core.queue` still holds it.
    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut Self::Vol) -> Verdict;
    /// Charges a dispatched request (`core.queue` no longer holds it).
    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut Self::Vol);
    /// The node pacer now runs at `capacity` (see [`Policy::set_capacity`]): the rules adapt
    /// what they derived from the capacity (Burst: window capacity, reserve, burst pacer).
    /// Called only on a real change, after `tick` has run at `now_ns`.
    fn set_capacity(&mut self, _now_ns: u64, _capacity: NodeCapacity) {}
    /// Periodic work (Burst's window allocation).
    fn tick(&mut self, _now_ns: u64, _vols: &mut Slab<Entry<Self::Vol>>) -> Option<Tick> {
        None
    }
    /// Restores a volume's persisted credit balances (see [`Policy::restore_credits`]);
    /// returns whether anything changed, so that the engine places the volume again (it may
    /// have been waiting for credits). Policies without credit buckets keep the default no-op.
    fn restore_credits(
        &mut self,
        _now_ns: u64,
        _vol: &mut Self::Vol,
        _iops_credits: Option<u64>,
        _bytes_credits: Option<u64>,
    ) -> bool {
        false
    }
    /// Credit balances for snapshots.
    fn credits(&self, _now_ns: u64, _vol: &Self::Vol) -> (Option<u64>, Option<u64>) {
        (None, None)
    }
    /// Policy-specific invariants (credit ranges, allocation sums).
    fn check(&self, _vols: &Slab<Entry<Self::Vol>>) -> Result<(), String> {
        Ok(())
    }
    /// Whether the baseline guarantee applies to this policy, and with which reserve (permille).
    fn baseline_guarantee(&self) -> Option<u64>;
    /// For work-conserving policies: whether a backlogged volume *must* be able to run at
    /// `now_ns` given that the node pacer is fully idle (`None` = policy is not work-conserving).
    fn must_run(
        &self,
        _now_ns: u64,
        _core: &VolCore,
        _vol: &Self::Vol,
        _charge: Charge,
        _cost: &CostVector,
    ) -> Option<bool> {
        None
    }
}

/// What periodic work asks the engine to do.
#[derive(Debug, Default)]
pub(crate) struct Tick {
    /// Volumes to place again.
    pub(crate) replace: Vec<u32>,
    /// Move every entry of ring `.0` to the back of ring `.1` (cheaper than re-placing each
    /// volume; a volume moved to a better ring than it deserves is corrected at its turn).
    pub(crate) merge: Option<(usize, usize)>,
}

/// A volume in the engine: the common part and the policy's part.
///
/// `repr(C)`: the promotion time next to the slot's generation (a promotion firing reads
/// both), then the policy's limiters, then the common part, whose cold QoS record comes last.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Entry<V> {
    /// Time of this volume's pending promotion timer (0: none).
    promo_at_ns: u64,
    pub(crate) x: V,
    pub(crate) core: VolCore,
}

/// A ring-based policy: [`Rules`] plus the shared mechanics.
#[derive(Debug)]
pub(crate) struct Engine<R: Rules> {
    pub(crate) rules: R,
    clock: Clock,
    pub(crate) vols: Slab<Entry<R::Vol>>,
    ready: Ready,
    pacer: Pacer,
    tracker: Tracker,
    /// See [`crate::PolicyParams::reorder_lookahead`].
    reorder_lookahead: usize,
    /// The dimensions every request enqueued so far needed ([`CostVector::dims_mask`] bits,
    /// all set before the first): a request waiting on one of them means no request could
    /// run, so `next` does not look for one.
    common_dims: u8,
    /// Placements `(class, slot, generation)` that `next` took off the front of their rings
    /// because their head request waits for the pacer; put back in front, in order, before
    /// `next` returns (kept here to reuse the allocation).
    passed_over: Vec<(usize, u32, u32)>,
}

impl<R: Rules> Engine<R> {
    pub(crate) fn new(
        rules: R,
        capacity: NodeCapacity,
        window_ns: u64,
        depth_ns: u64,
        track_invariants: bool,
    ) -> Self {
        let classes = rules.classes();
        let name = rules.name();
        Engine {
            rules,
            clock: Clock::default(),
            vols: Slab::default(),
            ready: Ready::new(classes),
            pacer: Pacer::new(0, capacity.per_second),
            tracker: Tracker::new(
                name,
                window_ns,
                capacity.per_second,
                depth_ns,
                track_invariants,
            ),
            reorder_lookahead: 0,
            common_dims: u8::MAX,
            passed_over: Vec::new(),
        }
    }

    /// Lets the engine run a request up to `lookahead` places behind a volume's head first
    /// when the head waits for a dimension that request does not need (see
    /// [`crate::PolicyParams::reorder_lookahead`]).
    pub(crate) fn with_reorder_lookahead(mut self, lookahead: u32) -> Self {
        self.reorder_lookahead = lookahead as usize;
        self
    }

    /// Lets the node pacer save up `depth_ns` of unused capacity (see
    /// [`crate::policy::PolicyParams::pacer_depth_ns`]).
    pub(crate) fn with_pacer_depth(mut self, capacity: NodeCapacity, depth_ns: u64) -> Self {
        if depth_ns > 0 {
            self.pacer = Pacer::with_depth(0, capacity.per_second, depth_ns);
            self.tracker.allow_pacer_depth(depth_ns);
        }
        self
    }

    fn ensure_volume(&mut self, now: u64, id: VolumeId) -> u32 {
        if let Some(idx) = self.vols.lookup(id) {
            return idx;
        }
        self.insert_volume(now, id, &VolumeQos::default())
    }

    fn insert_volume(&mut self, now: u64, id: VolumeId, qos: &VolumeQos) -> u32 {
        let idx = self.vols.vacant_index();
        let x = self.rules.new_vol(now, idx, qos);
        let core = VolCore::new(id, *qos);
        self.tracker.on_add(now, idx, qos);
        self.vols.insert(
            id,
            Entry {
                core,
                x,
                promo_at_ns: 0,
            },
        )
    }

    /// Places a volume again (bumping its generation); `front` puts it at the front of its ring.
    fn place(&mut self, now: u64, idx: u32, front: bool) {
        let Some(head) = self.vols.get(idx).and_then(|e| {
            e.core
                .queue
                .front()
                .map(|req| (e.core.charge(req), req.cost))
        }) else {
            // Nothing queued: the volume is not placed (older placements go stale).
            self.vols.bump(idx);
            return;
        };
        self.place_head(now, idx, front, head.0, &head.1);
    }

    /// [`Engine::place`] for a volume whose head request's `charge` and `cost` the caller
    /// already has: an enqueue onto an empty queue places from the request in registers
    /// instead of reading back the copy it just stored into the (often cache-cold) queue.
    fn place_head(&mut self, now: u64, idx: u32, front: bool, charge: Charge, cost: &CostVector) {
        let generation = self.vols.bump(idx);
        let Some(e) = self.vols.get_mut(idx) else {
            return;
        };
        let cost = *cost;
        match self
            .rules
            .classify(now, idx, &e.core, &mut e.x, charge, &cost)
        {
            Place::Ring {
                class,
                front: class_front,
                reclassify_at,
            } => {
                if front || class_front {
                    self.ready.push_front(class, idx, generation);
                } else {
                    self.ready.push_back(class, idx, generation);
                }
                // One pending promotion per volume: an earlier one re-places the volume, which
                // then schedules the next if still needed.
                if let Some(t) = reclassify_at
                    && (e.promo_at_ns == 0 || e.promo_at_ns > t)
                {
                    e.promo_at_ns = t;
                    self.ready.promotion(t, idx, self.vols.incarnation_of(idx));
                }
            }
            Place::At(t) => self.ready.timer(t, idx, generation),
        }
    }

    /// Credit balances of a volume as they will be at `now_ns` (no state change).
    pub(crate) fn credits_at(&self, id: VolumeId, now_ns: u64) -> (Option<u64>, Option<u64>) {
        self.vols
            .lookup(id)
            .and_then(|idx| self.vols.get(idx))
            .map_or((None, None), |e| self.rules.credits(now_ns, &e.x))
    }

    fn run_tick(&mut self, now: u64) {
        if let Some(tick) = self.rules.tick(now, &mut self.vols) {
            if let Some((from, to)) = tick.merge {
                self.ready.merge(from, to);
            }
            for idx in tick.replace {
                self.place(now, idx, false);
            }
        }
    }

    fn queued_total(&self) -> usize {
        self.vols.iter().map(|(_, e)| e.core.queue.len()).sum()
    }

    fn pacer_idle(&self, now: u64) -> bool {
        self.pacer.idle_at(now)
    }

    /// [`Policy::next`] after the due timers have fired: the first request that may run now,
    /// else when to ask again. Volumes whose head request waits for the node pacer are set
    /// aside in `passed_over` (the caller puts them back), so that the requests behind them,
    /// in the same ring or in a later class, are not held back by a dimension they do not
    /// need.
    fn choose(&mut self, now: u64) -> Decision {
        // Bounded: every iteration either dispatches, returns, rotates a volume whose rules
        // guarantee it can run after one rotation, moves a request forward in a volume's
        // queue (at most `MAX_REORDERS` times) or sets a volume aside (each at most once).
        let mut rotations = 0usize;
        let mut reorders = 0usize;
        // The dimensions that held a head request back so far, and when the first request
        // set aside may run.
        let mut blocked_dims = 0u8;
        let mut blocked_until = u64::MAX;
        loop {
            let mut candidate = None;
            for class in 0..self.rules.classes() {
                if let Some(idx) = self.ready.front_current(class, &self.vols) {
                    candidate = Some((class, idx));
                    break;
                }
            }
            let Some((class, idx)) = candidate else {
                break;
            };
            let Some(e) = self.vols.get_mut(idx) else {
                self.ready.pop_front(class);
                continue;
            };
            let Some(head) = e.core.queue.front() else {
                self.ready.pop_front(class);
                continue;
            };
            let cost = head.cost;
            let charge = e.core.charge(head);
            let eff_class = self.rules.effective_class(now, class, &e.x, charge);
            let baseline_class = self.rules.is_baseline_class(eff_class);
            let protected = baseline_class && self.rules.baseline_allowance(now, idx, &e.x);
            let gate = self
                .pacer
                .ready_at(now, &cost, protected)
                .max(self.rules.class_gate(now, eff_class, &cost));
            if gate > now {
                let blocking = self.pacer.blocking_dims(now, &cost, protected)
                    | self.rules.class_blocking_dims(now, eff_class, &cost);
                blocked_dims |= blocking;
                // Whether some request could avoid what holds this one back: not when every
                // request needs a blocking dimension. A bursting volume's baseline request
                // waits where the baseline requests behind it may still run inside the
                // pacer's allowance.
                let avoidable = blocking & self.common_dims == 0;
                if (avoidable || (baseline_class && !protected))
                    && self.passed_over.len() < MAX_PASSED_OVER
                {
                    // First a request of this volume that needs none of the dimensions seen
                    // blocking: it runs ahead of the head.
                    if avoidable && reorders < MAX_REORDERS {
                        let found = e
                            .core
                            .queue
                            .iter()
                            .take(self.reorder_lookahead.saturating_add(1))
                            .skip(1)
                            .position(|r| r.cost.dims_mask() & blocked_dims == 0);
                        if let Some(pos) = found
                            && let Some(req) = e.core.queue.remove(pos + 1)
                        {
                            e.core.queue.push_front(req);
                            reorders += 1;
                            self.ready.pop_front(class);
                            self.place(now, idx, true);
                            continue;
                        }
                    }
                    // Else the volume is set aside for this call, keeping its turn.
                    if let Some((idx, generation)) = self.ready.pop_front(class) {
                        self.passed_over.push((class, idx, generation));
                    }
                    blocked_until = blocked_until.min(gate);
                    continue;
                }
                let gate = gate.min(blocked_until);
                let wake = self
                    .ready
                    .next_timer(&self.vols)
                    .map_or(gate, |t| t.min(gate));
                self.tracker.on_idle(now);
                return Decision::WaitUntil(wake);
            }
            let verdict = {
                let Some(e) = self.vols.get_mut(idx) else {
                    continue;
                };
                let Some(head) = e.core.queue.front() else {
                    continue;
                };
                self.rules.verdict(
                    &Ctx {
                        now_ns: now,
                        idx,
                        class: eff_class,
                        core: &e.core,
                        charge,
                        req: head,
                    },
                    &mut e.x,
                )
            };
            self.ready.pop_front(class);
            match verdict {
                Verdict::Rotate => {
                    rotations += 1;
                    self.place(now, idx, false);
                    if rotations > 2 * self.vols.len() + 2 {
                        // Defensive: never spin; ask again immediately.
                        self.tracker.on_idle(now);
                        return Decision::WaitUntil(now.saturating_add(1));
                    }
                }
                Verdict::Run { phase, front } => {
                    // Only the per-volume invariant tracking needs the ceiling.
                    let ceiling = if self.tracker.per_volume {
                        self.vols
                            .get(idx)
                            .map(|e| self.rules.enforced_ceiling(&e.core.qos))
                    } else {
                        None
                    };
                    let Some(e) = self.vols.get_mut(idx) else {
                        continue;
                    };
                    let Some(req) = e.core.queue.pop_front() else {
                        continue;
                    };
                    self.pacer.take(now, &req.cost);
                    self.rules.charge(
                        &Ctx {
                            now_ns: now,
                            idx,
                            class: eff_class,
                            core: &e.core,
                            charge,
                            req: &req,
                        },
                        phase,
                        &mut e.x,
                    );
                    e.core.stats.record(phase, charge.bytes);
                    self.tracker.on_dispatch(
                        now,
                        idx,
                        &e.core,
                        &req,
                        charge,
                        ceiling.unwrap_or(IoRate::UNLIMITED),
                    );
                    self.place(now, idx, front);
                    return Decision::Dispatch(req, phase);
                }
            }
        }
        self.tracker.on_idle(now);
        if self.tracker.queued == 0 {
            return Decision::Idle;
        }
        Decision::WaitUntil(
            self.ready
                .next_timer(&self.vols)
                .unwrap_or(u64::MAX)
                .min(blocked_until),
        )
    }
}

impl<R: Rules> Policy for Engine<R> {
    fn name(&self) -> &'static str {
        self.rules.name()
    }

    fn add_volume(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos) {
        let now = self.clock.at(now_ns);
        if self.vols.lookup(id).is_some() {
            self.update_qos(now, id, qos);
            return;
        }
        self.insert_volume(now, id, qos);
        self.tracker.idle_claim = false;
    }

    fn update_qos(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos) {
        let now = self.clock.at(now_ns);
        let Some(idx) = self.vols.lookup(id) else {
            self.add_volume(now, id, qos);
            return;
        };
        let ceiling = self.rules.enforced_ceiling(qos);
        if let Some(e) = self.vols.get_mut(idx) {
            e.core.set_qos(*qos);
            self.rules.reconfigure(now, idx, qos, &mut e.x);
            self.tracker.on_qos_change(now, idx, &e.core, ceiling);
        }
        self.place(now, idx, false);
    }

    fn restore_credits(
        &mut self,
        now_ns: u64,
        id: VolumeId,
        iops_credits: Option<u64>,
        bytes_credits: Option<u64>,
    ) {
        let now = self.clock.at(now_ns);
        // Unlike a request, a restore does not register an unknown volume.
        let Some(idx) = self.vols.lookup(id) else {
            return;
        };
        let changed = self.vols.get_mut(idx).is_some_and(|e| {
            self.rules
                .restore_credits(now, &mut e.x, iops_credits, bytes_credits)
        });
        if changed {
            // A volume waiting for credits may run now (or, restored lower, later).
            self.place(now, idx, false);
        }
    }

    fn remove_volume(&mut self, now_ns: u64, id: VolumeId) {
        let now = self.clock.at(now_ns);
        if let Some((idx, e)) = self.vols.remove(id) {
            self.rules.removed(now, idx, &e.x);
            self.tracker.on_remove(e.core.queue.len());
        }
    }

    fn set_capacity(&mut self, now_ns: u64, capacity: NodeCapacity) {
        let now = self.clock.at(now_ns);
        if capacity.per_second == self.tracker.capacity {
            return;
        }
        // Windows that began before the change close (and Burst's next allocation is made)
        // with the capacity in effect when they began.
        self.run_tick(now);
        self.pacer.set_rate(now, capacity.per_second);
        self.rules.set_capacity(now, capacity);
        self.tracker.on_capacity_change(now, capacity.per_second);
    }

    fn enqueue(&mut self, now_ns: u64, req: IoRequest) {
        let now = self.clock.at(now_ns);
        self.run_tick(now);
        let idx = self.ensure_volume(now, req.volume);
        let Some(e) = self.vols.get_mut(idx) else {
            return;
        };
        let was_empty = e.core.queue.is_empty();
        let head = was_empty.then(|| (e.core.charge(&req), req.cost));
        self.common_dims &= req.cost.dims_mask();
        e.core.queue.push_back(req);
        self.tracker.on_enqueue(now, idx, &e.core);
        if let Some((charge, cost)) = head {
            self.rules.became_backlogged(now, idx, &mut e.x);
            self.place_head(now, idx, false, charge, &cost);
        }
    }

    fn next(&mut self, now_ns: u64) -> Decision {
        let now = self.clock.at(now_ns);
        if self.tracker.queued == 0 {
            // Nothing queued, so nothing can run and no timer is worth arming: `choose` would
            // say the same after the work below, none of which can queue a request. That work
            // waits for the next call with a request queued, as it does while the node is idle
            // (the window tick catches up by its gap; timers and promotions of volumes with
            // empty queues only go stale). The caller asks again after every request it
            // dispatches, so this is half the calls on a node that is keeping up.
            self.tracker.on_idle(now);
            return Decision::Idle;
        }
        self.run_tick(now);
        while let Some(idx) = self.ready.pop_due(now, &self.vols) {
            self.place(now, idx, false);
        }
        while let Some((idx, at)) = self.ready.pop_due_promotion(now, &self.vols) {
            let pending = self.vols.get_mut(idx).map(|e| {
                let mine = e.promo_at_ns == at;
                if mine {
                    e.promo_at_ns = 0;
                }
                mine
            });
            if pending == Some(true) {
                self.place(now, idx, false);
            }
        }
        let decision = self.choose(now);
        // Volumes passed over keep their turn: back in front of their rings, in order.
        while let Some((class, idx, generation)) = self.passed_over.pop() {
            self.ready.push_front(class, idx, generation);
        }
        decision
    }

    fn complete(&mut self, now_ns: u64, req: &IoRequest, _observed: Observed) {
        self.clock.at(now_ns);
        self.tracker.on_complete(&self.vols, req.volume);
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.tracker.check_common(self.queued_total())?;
        self.rules
            .check(&self.vols)
            .map_err(|d| self.tracker.violation("policy", d))?;
        if let Some(reserve) = self.rules.baseline_guarantee() {
            self.tracker.check_baseline(
                &self
                    .vols
                    .iter()
                    .map(|(idx, e)| (idx, &e.core))
                    .collect::<Vec<_>>(),
                reserve,
            )?;
        }
        if self.tracker.idle_claim {
            let now = self.tracker.last_next_ns;
            if self.pacer_idle(now) {
                for (_, e) in self.vols.iter() {
                    let Some(head) = e.core.queue.front() else {
                        continue;
                    };
                    let charge = Charge::of(&e.core.qos, head);
                    if self.rules.must_run(now, &e.core, &e.x, charge, &head.cost) == Some(true) {
                        return Err(self.tracker.violation(
                            "work_conserving",
                            format!(
                                "at {now} ns the node is idle but volume {} (below its ceiling) has {} queued requests",
                                e.core.id,
                                e.core.queue.len()
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    fn queued_requests(&self) -> usize {
        usize::try_from(self.tracker.queued).unwrap_or(usize::MAX)
    }

    fn snapshot(&self, id: VolumeId) -> Option<VolumeSnapshot> {
        let idx = self.vols.lookup(id)?;
        let e = self.vols.get(idx)?;
        Some(e.core.snapshot(self.rules.credits(self.clock.last(), &e.x)))
    }
}
