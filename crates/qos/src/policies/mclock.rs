//! mClock (Gulati, Merchant, Varman, OSDI'10): reservation, weight and limit tags.
//!
//! Reservation = the volume's baseline, limit = its burst ceiling, weight = its weight.
//! Tags are kept per volume for its head request, in exact integer time: a tag is an anchor
//! time plus the service charged since the anchor divided by the rate, so 1/r increments
//! that are not whole nanoseconds never accumulate rounding. Idle volumes earn no credit (a
//! tag behind `now` is re-anchored at `now` when the volume becomes backlogged).
//!
//! Dispatch: (1) among volumes under their limit, the smallest reservation tag if it is due —
//! phase `baseline`; (2) otherwise the smallest proportional tag among volumes under their
//! limit — phase `burst_spare`, and that service is removed from the reservation clock so it
//! does not count toward the reservation (dmClock's ρ/δ rule). Deviation from the paper: the
//! limit is enforced in the reservation phase too, so a ceiling is never exceeded even
//! transiently; since reservation ≤ limit this cannot starve a reservation.
//!
//! Proportional tags use start-time fair queueing in virtual time (the smallest tag handed out
//! so far), which is how Ceph shifts a re-activated client's tags instead of giving it the
//! real-time advantage of plain `max(P + 1/w, now)`.

use crate::cost::mul_div_ceil;
use crate::error::InvariantViolation;
use crate::limiter::{Charge, Pacer};
use crate::policy::{Policy, VolumeSnapshot};
use crate::sched::{Clock, Slab, VolCore};
use crate::tracker::Tracker;
use crate::vocab::{
    Decision, IoRate, IoRequest, NS_PER_S, NodeCapacity, Observed, Phase, VolumeId, VolumeQos,
};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Virtual-time units per I/O unit at weight 1.
const P_SCALE: u128 = 1 << 20;

/// An exact rate clock in one dimension: `anchor_ns + served / rate`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct DimClock {
    anchor_ns: u64,
    served: u64,
}

impl DimClock {
    fn tag(&self, rate: u64) -> u64 {
        self.anchor_ns.saturating_add(tag_dim(self.served, rate))
    }

    fn catch_up(&mut self, now_ns: u64, rate: u64) {
        if self.tag(rate) < now_ns {
            *self = DimClock {
                anchor_ns: now_ns,
                served: 0,
            };
        }
    }

    /// Live rate change: the service still owed at the old rate (the tag's distance ahead of
    /// `now`) is re-timed at the new rate, like a token bucket that keeps its level.
    fn rebase(&mut self, old_rate: u64, new_rate: u64, now_ns: u64) {
        let tag = self.tag(old_rate);
        let ahead_ns = if tag == u64::MAX || old_rate == u64::MAX {
            0
        } else {
            tag.saturating_sub(now_ns)
        };
        let ahead_new = if ahead_ns == 0 {
            0
        } else {
            mul_div_ceil(ahead_ns, old_rate, new_rate)
        };
        *self = DimClock {
            anchor_ns: now_ns.saturating_add(ahead_new),
            served: 0,
        };
    }
}

/// Rate clocks in both dimensions. A request is due when every dimension it uses is due, so a
/// request without payload is not held back by the bytes of an earlier one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct TagClock {
    units: DimClock,
    bytes: DimClock,
}

impl TagClock {
    fn at(now_ns: u64) -> Self {
        let d = DimClock {
            anchor_ns: now_ns,
            served: 0,
        };
        TagClock { units: d, bytes: d }
    }

    /// When a request of `charge` is due under `rate` (`u64::MAX`: never).
    fn tag(&self, rate: IoRate, charge: Charge) -> u64 {
        let u = self.units.tag(rate.iops);
        if charge.bytes == 0 {
            u
        } else {
            u.max(self.bytes.tag(rate.bytes_per_s))
        }
    }

    /// Re-anchors each dimension at `now_ns` if it fell behind (no credit for idleness).
    fn catch_up(&mut self, now_ns: u64, rate: IoRate) {
        self.units.catch_up(now_ns, rate.iops);
        self.bytes.catch_up(now_ns, rate.bytes_per_s);
    }

    fn add(&mut self, c: Charge) {
        self.units.served = self.units.served.saturating_add(c.units);
        self.bytes.served = self.bytes.served.saturating_add(c.bytes);
    }

    /// Live QoS change: what is owed is kept and re-timed at the new rate (no fresh credit,
    /// no penalty).
    fn rebase(&mut self, old: IoRate, new: IoRate, now_ns: u64) {
        self.units.rebase(old.iops, new.iops, now_ns);
        self.bytes.rebase(old.bytes_per_s, new.bytes_per_s, now_ns);
    }
}

fn tag_dim(served: u64, rate_per_s: u64) -> u64 {
    match rate_per_s {
        u64::MAX => 0,
        0 => {
            if served == 0 {
                0
            } else {
                u64::MAX
            }
        }
        r => mul_div_ceil(served, NS_PER_S, r),
    }
}

#[derive(Debug)]
struct MVol {
    core: VolCore,
    reservation: TagClock,
    limit: TagClock,
    /// Start tag of the head request in virtual time.
    p_start: u128,
    /// The sequence number of this volume's one valid entry in `MClock::by_res` (0: none).
    /// A weight-phase dispatch leaves the reservation tag unchanged, so the entry is kept
    /// instead of pushing a copy under a new generation: those copies piled up below the top
    /// of the heap (one per I/O of every volume served above its reservation) and made every
    /// pop walk a heap thousands deep.
    res_seq: u64,
    /// The tag of that entry.
    res_tag: u64,
}

impl MVol {
    fn res_rate(&self) -> IoRate {
        self.core.qos.baseline
    }

    fn lim_rate(&self) -> IoRate {
        self.core.qos.burst_ceiling()
    }

    fn has_reservation(&self) -> bool {
        let r = self.res_rate();
        r.iops > 0 && r.bytes_per_s > 0
    }
}

/// The mClock policy.
#[derive(Debug)]
pub(crate) struct MClock {
    clock: Clock,
    vols: Slab<MVol>,
    /// Volumes under their limit, by reservation tag: `(tag, slot, sequence)`, valid while the
    /// slot's volume holds that sequence number (`MVol::res_seq`).
    by_res: BinaryHeap<Reverse<(u64, u32, u64)>>,
    /// Sequence numbers of `by_res` entries (never reused, so an entry of a removed volume
    /// never matches the volume that takes its slot).
    next_res_seq: u64,
    /// Volumes under their limit, by proportional start tag.
    by_prop: BinaryHeap<Reverse<(u128, u32, u32)>>,
    /// Volumes over their limit, by limit tag.
    by_limit: BinaryHeap<Reverse<(u64, u32, u32)>>,
    vtime: u128,
    pacer: Pacer,
    tracker: Tracker,
    /// How far the limit clock may lag `now` while backlogged (catch-up after being held back).
    depth_ns: u64,
}

impl MClock {
    pub(crate) fn new(
        capacity: NodeCapacity,
        window_ns: u64,
        depth_ns: u64,
        track_invariants: bool,
    ) -> Self {
        MClock {
            clock: Clock::default(),
            vols: Slab::default(),
            by_res: BinaryHeap::new(),
            next_res_seq: 1,
            by_prop: BinaryHeap::new(),
            by_limit: BinaryHeap::new(),
            vtime: 0,
            pacer: Pacer::new(0, capacity.per_second),
            tracker: Tracker::new(
                "mclock",
                window_ns,
                capacity.per_second,
                depth_ns,
                track_invariants,
            ),
            depth_ns,
        }
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

    fn place(&mut self, now_ns: u64, idx: u32) {
        let generation = self.vols.bump(idx);
        let Some(v) = self.vols.get_mut(idx) else {
            return;
        };
        let Some(head) = v.core.queue.front() else {
            v.res_seq = 0;
            return;
        };
        let charge = v.core.charge(head);
        // Under the limit when the limit tag is due: like every limiter here, one request deep.
        let lim = v.limit.tag(v.lim_rate(), charge);
        if lim > now_ns {
            v.res_seq = 0;
            if lim != u64::MAX {
                self.by_limit.push(Reverse((lim, idx, generation)));
            }
            return;
        }
        if v.has_reservation() {
            let r = v.reservation.tag(v.res_rate(), charge);
            if v.res_seq == 0 || v.res_tag != r {
                v.res_seq = self.next_res_seq;
                v.res_tag = r;
                self.next_res_seq += 1;
                self.by_res.push(Reverse((r, idx, v.res_seq)));
            }
        } else {
            v.res_seq = 0;
        }
        self.by_prop.push(Reverse((v.p_start, idx, generation)));
    }

    fn promote_due(&mut self, now_ns: u64) {
        while let Some(&Reverse((t, idx, generation))) = self.by_limit.peek() {
            if !self.vols.is_current(idx, generation) {
                self.by_limit.pop();
                continue;
            }
            if t > now_ns {
                break;
            }
            self.by_limit.pop();
            self.place(now_ns, idx);
        }
    }

    fn min_res(&mut self) -> Option<(u64, u32)> {
        while let Some(&Reverse((t, idx, seq))) = self.by_res.peek() {
            if self.vols.get(idx).is_some_and(|v| v.res_seq == seq) {
                return Some((t, idx));
            }
            self.by_res.pop();
        }
        None
    }

    fn min_prop(&mut self) -> Option<(u128, u32)> {
        while let Some(&Reverse((p, idx, generation))) = self.by_prop.peek() {
            if self.vols.is_current(idx, generation) {
                return Some((p, idx));
            }
            self.by_prop.pop();
        }
        None
    }

    fn min_limit(&mut self) -> Option<u64> {
        while let Some(&Reverse((t, idx, generation))) = self.by_limit.peek() {
            if self.vols.is_current(idx, generation) {
                return Some(t);
            }
            self.by_limit.pop();
        }
        None
    }

    fn ensure(&mut self, now_ns: u64, id: VolumeId) -> u32 {
        match self.vols.lookup(id) {
            Some(i) => i,
            None => self.insert(now_ns, id, &VolumeQos::default()),
        }
    }

    fn insert(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos) -> u32 {
        let core = VolCore::new(id, *qos);
        self.tracker.on_add(now_ns, self.vols.vacant_index(), qos);
        self.vols.insert(
            id,
            MVol {
                core,
                reservation: TagClock::at(now_ns),
                limit: TagClock::at(now_ns),
                p_start: self.vtime,
                res_seq: 0,
                res_tag: 0,
            },
        )
    }

    fn dispatch(&mut self, now_ns: u64, idx: u32, phase: Phase) -> Option<Decision> {
        let depth_ns = self.depth_ns;
        let v = self.vols.get_mut(idx)?;
        let req = v.core.queue.pop_front()?;
        let charge = v.core.charge(&req);
        // The limit clock lags `now_ns` by at most the limiter depth: a volume held back
        // (behind the node pacer) may catch up that much, never more (no burst above the limit).
        let lim_rate = v.lim_rate();
        v.limit.catch_up(now_ns.saturating_sub(depth_ns), lim_rate);
        v.limit.add(charge);
        if phase == Phase::Baseline {
            v.reservation.add(charge);
        }
        let w = u128::from(v.core.weight.max(1));
        v.p_start = v
            .p_start
            .saturating_add(u128::from(charge.units) * P_SCALE / w);
        let ceiling = v.lim_rate();
        self.pacer.take(now_ns, &req.cost);
        v.core.stats.record(phase, charge.bytes);
        self.tracker
            .on_dispatch(now_ns, idx, &v.core, &req, charge, ceiling);
        self.place(now_ns, idx);
        Some(Decision::Dispatch(req, phase))
    }

    /// Nothing runs now: wake at `at_ns` or at the next tag that falls due, whichever is first
    /// (a request blocked by the pacer must not hide another volume's reservation).
    fn wait(&mut self, now_ns: u64, at_ns: u64) -> Decision {
        self.tracker.on_idle(now_ns);
        let wake = [
            Some(at_ns),
            self.min_limit(),
            self.min_res().map(|(r, _)| r),
        ]
        .into_iter()
        .flatten()
        .filter(|&x| x > now_ns)
        .min();
        Decision::WaitUntil(wake.unwrap_or(u64::MAX))
    }

    fn queued_total(&self) -> usize {
        self.vols.iter().map(|(_, v)| v.core.queue.len()).sum()
    }
}

impl Policy for MClock {
    fn name(&self) -> &'static str {
        "mclock"
    }

    fn add_volume(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos) {
        let now = self.clock.at(now_ns);
        if self.vols.lookup(id).is_some() {
            self.update_qos(now, id, qos);
        } else {
            self.insert(now, id, qos);
            self.tracker.idle_claim = false;
        }
    }

    fn update_qos(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos) {
        let now = self.clock.at(now_ns);
        let Some(idx) = self.vols.lookup(id) else {
            self.add_volume(now, id, qos);
            return;
        };
        if let Some(v) = self.vols.get_mut(idx) {
            let (old_res, old_lim) = (v.res_rate(), v.lim_rate());
            v.core.set_qos(*qos);
            let (new_res, new_lim) = (v.res_rate(), v.lim_rate());
            v.reservation.rebase(old_res, new_res, now);
            v.limit.rebase(old_lim, new_lim, now);
            let ceiling = v.lim_rate();
            self.tracker.on_qos_change(now, idx, &v.core, ceiling);
        }
        self.place(now, idx);
    }

    fn remove_volume(&mut self, now_ns: u64, id: VolumeId) {
        self.clock.at(now_ns);
        if let Some((_, v)) = self.vols.remove(id) {
            self.tracker.on_remove(v.core.queue.len());
        }
    }

    fn set_capacity(&mut self, now_ns: u64, capacity: NodeCapacity) {
        let now = self.clock.at(now_ns);
        if capacity.per_second == self.tracker.capacity {
            return;
        }
        // Tags are per volume and in the volumes' own rates: only the node pacer changes.
        self.pacer.set_rate(now, capacity.per_second);
        self.tracker.on_capacity_change(now, capacity.per_second);
    }

    fn enqueue(&mut self, now_ns: u64, req: IoRequest) {
        let now = self.clock.at(now_ns);
        let idx = self.ensure(now, req.volume);
        let vtime = self.vtime;
        let Some(v) = self.vols.get_mut(idx) else {
            return;
        };
        let was_empty = v.core.queue.is_empty();
        v.core.queue.push_back(req);
        self.tracker.on_enqueue(now, idx, &v.core);
        if was_empty {
            let (r, l) = (v.res_rate(), v.lim_rate());
            v.reservation.catch_up(now, r);
            v.limit.catch_up(now, l);
            v.p_start = v.p_start.max(vtime);
            self.place(now, idx);
        }
    }

    fn next(&mut self, now_ns: u64) -> Decision {
        let now = self.clock.at(now_ns);
        self.promote_due(now);
        // Constraint phase.
        if let Some((r, idx)) = self.min_res()
            && r <= now
        {
            let cost = self
                .vols
                .get(idx)
                .and_then(|v| v.core.queue.front())
                .map(|q| q.cost);
            if let Some(cost) = cost {
                let t = self.pacer.ready_at(now, &cost, true);
                if t > now {
                    return self.wait(now, t);
                }
                if let Some(d) = self.dispatch(now, idx, Phase::Baseline) {
                    return d;
                }
            }
        }
        // Weight phase.
        if let Some((p, idx)) = self.min_prop() {
            let cost = self
                .vols
                .get(idx)
                .and_then(|v| v.core.queue.front())
                .map(|q| q.cost);
            if let Some(cost) = cost {
                let t = self.pacer.ready_at(now, &cost, false);
                if t > now {
                    return self.wait(now, t);
                }
                self.vtime = self.vtime.max(p);
                // dmClock: service in the weight phase does not count toward the reservation,
                // so the reservation clock is not advanced here (it is only advanced in the
                // constraint phase), which is the same as subtracting it afterwards.
                if let Some(d) = self.dispatch(now, idx, Phase::BurstSpare) {
                    return d;
                }
            }
        }
        if self.tracker.queued == 0 {
            self.tracker.on_idle(now);
            return Decision::Idle;
        }
        self.wait(now, u64::MAX)
    }

    fn complete(&mut self, now_ns: u64, req: &IoRequest, _observed: Observed) {
        self.clock.at(now_ns);
        self.tracker.on_complete(&self.vols, req.volume);
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.tracker.check_common(self.queued_total())?;
        self.tracker.check_baseline(
            &self
                .vols
                .iter()
                .map(|(idx, v)| (idx, &v.core))
                .collect::<Vec<_>>(),
            0,
        )?;
        Ok(())
    }

    fn queued_requests(&self) -> usize {
        usize::try_from(self.tracker.queued).unwrap_or(usize::MAX)
    }

    fn snapshot(&self, id: VolumeId) -> Option<VolumeSnapshot> {
        let idx = self.vols.lookup(id)?;
        Some(self.vols.get(idx)?.core.snapshot((None, None)))
    }
}
