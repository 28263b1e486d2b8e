//! Invariant tracking: the bookkeeping every policy is checked against, kept apart from the
//! structures it schedules with (`crate::sched`).
//!
//! Why a module of its own: [`Tracker`] is verification. It records every enqueue, dispatch,
//! completion, QoS and capacity change of a policy and checks the invariants that
//! `Policy::check_invariants` reports (request accounting, capacity per window, each volume's
//! ceiling per window, and the baseline guarantee, against a [`ShadowMeter`] per volume). The
//! engines read only its node-wide counters (requests queued, for `Idle` and
//! `queued_requests`; the capacity in effect, to ignore the same capacity again); the
//! per-volume part ([`VolTrack`]) is touched only when `PolicyParams::track_invariants` is on,
//! and no decision reads it (the proptests run every case with it on and off and compare).

use crate::bucket::TokenBucket;
use crate::cost::{CostVector, mul_div_ceil};
use crate::error::InvariantViolation;
use crate::limiter::{Charge, depth_units};
use crate::sched::{Slab, VolCore};
use crate::vocab::{IoRate, IoRequest, NS_PER_S, VolumeId, VolumeQos};
use std::collections::VecDeque;

/// Invariant bookkeeping. Dispatch-time checks are O(1); scans over all volumes only happen in
/// `check_invariants`.
///
/// The node-wide part (request accounting, capacity per window, the idle claim) is always on.
/// The per-volume part ([`VolTrack`]: ceiling per window, baseline shadow meter, in-flight
/// count) is verification, not scheduling: it lives in its own array indexed by slot, touched
/// only when `per_volume` is on (`PolicyParams::track_invariants`), so that a volume's hot
/// scheduling state stays small when it is off.
#[derive(Debug)]
pub(crate) struct Tracker {
    pub(crate) policy: &'static str,
    /// Whether per-volume invariants are tracked (`vols`).
    pub(crate) per_volume: bool,
    vols: Vec<VolTrack>,
    pub(crate) window_ns: u64,
    /// Depth of per-volume limiters (how much service a held-back volume may catch up), ns.
    pub(crate) depth_ns: u64,
    /// The capacity in effect now (see [`Tracker::on_capacity_change`]).
    pub(crate) capacity: CostVector,
    /// The largest capacity in effect at any time during the current window (per dimension):
    /// what the capacity check of that window allows.
    window_capacity: CostVector,
    /// How much unused capacity the node pacer may save up, ns.
    pacer_depth_ns: u64,
    /// `window_capacity` per window, plus the pacer's depth and one nanosecond (the pacer's
    /// rounding allowance), precomputed.
    cap_per_window: CostVector,
    /// The last capacity changes, oldest first: `(time, capacity in effect before it)`, at
    /// most [`CAPACITY_HISTORY`] (the baseline check looks for the last time the capacity did
    /// not cover the baselines).
    capacity_changes: VecDeque<(u64, CostVector)>,
    /// The changes dropped from `capacity_changes`, folded: the latest one's time and the
    /// smallest capacity (per dimension) in effect before any of them.
    older_changes: Option<(u64, CostVector)>,
    window_idx: u64,
    window_end_ns: u64,
    cost_in_window: CostVector,
    max_cost_per_req: CostVector,
    first_violation: Option<InvariantViolation>,
    /// Time of the last `next()` call.
    pub(crate) last_next_ns: u64,
    /// The last `next()` returned no dispatch and nothing changed since: the policy claims
    /// nothing may run at `last_next_ns`.
    pub(crate) idle_claim: bool,
    pub(crate) enqueued: u64,
    pub(crate) dispatched: u64,
    pub(crate) dropped: u64,
    pub(crate) queued: u64,
}

impl Tracker {
    pub(crate) fn new(
        policy: &'static str,
        window_ns: u64,
        capacity: CostVector,
        depth_ns: u64,
        per_volume: bool,
    ) -> Self {
        Tracker {
            policy,
            per_volume,
            vols: Vec::new(),
            window_ns,
            depth_ns,
            capacity,
            window_capacity: capacity,
            pacer_depth_ns: 0,
            cap_per_window: capacity.mul_ratio_ceil(window_ns + 1, NS_PER_S),
            capacity_changes: VecDeque::new(),
            older_changes: None,
            window_idx: 0,
            window_end_ns: window_ns,
            cost_in_window: CostVector::ZERO,
            max_cost_per_req: CostVector::ZERO,
            first_violation: None,
            last_next_ns: 0,
            idle_claim: false,
            enqueued: 0,
            dispatched: 0,
            dropped: 0,
            queued: 0,
        }
    }

    fn violate(&mut self, invariant: &'static str, detail: String) {
        if self.first_violation.is_none() {
            self.first_violation = Some(InvariantViolation {
                policy: self.policy,
                invariant,
                detail,
            });
        }
    }

    /// The per-volume record of slot `idx` (grown on demand; tracking on only).
    fn vol_track(&mut self, idx: u32) -> &mut VolTrack {
        let i = idx as usize;
        if self.vols.len() <= i {
            self.vols.resize_with(i + 1, VolTrack::default);
        }
        &mut self.vols[i]
    }

    /// Records a new volume in slot `idx`: its baseline shadow meter starts like the policy's
    /// limiters.
    pub(crate) fn on_add(&mut self, now_ns: u64, idx: u32, qos: &VolumeQos) {
        self.idle_claim = false;
        if !self.per_volume {
            return;
        }
        let depth_ns = self.depth_ns;
        *self.vol_track(idx) = VolTrack {
            shadow: Some(ShadowMeter::new(now_ns, qos.baseline, depth_ns)),
            ..VolTrack::default()
        };
    }

    /// Records an enqueue on a volume (the request is already at the back of its queue).
    pub(crate) fn on_enqueue(&mut self, now_ns: u64, idx: u32, vol: &VolCore) {
        self.idle_claim = false;
        self.enqueued += 1;
        self.queued += 1;
        if !self.per_volume {
            return;
        }
        let depth_ns = self.depth_ns;
        let t = self.vol_track(idx);
        if let Some(req) = vol.queue.back() {
            let charge = Charge::of(&vol.qos, req);
            t.max_units_per_req = t.max_units_per_req.max(charge.units);
            t.max_bytes_per_req = t.max_bytes_per_req.max(charge.bytes);
            t.max_cost_per_req = t.max_cost_per_req.max(req.cost);
        }
        let baseline = vol.qos.baseline;
        if t.shadow.is_none() {
            t.shadow = Some(ShadowMeter::new(now_ns, baseline, depth_ns));
        }
        if vol.queue.len() == 1 {
            t.head_since_ns = Some(now_ns);
            // A volume becoming active is owed its baseline from now on: idleness saves up
            // at most one request (as mClock gives idle clients no credit).
            if let Some(m) = &mut t.shadow {
                m.activate(now_ns);
            }
        }
    }

    /// Records a QoS change of a volume.
    pub(crate) fn on_qos_change(
        &mut self,
        now_ns: u64,
        idx: u32,
        vol: &VolCore,
        enforced_ceiling: IoRate,
    ) {
        self.idle_claim = false;
        if !self.per_volume {
            return;
        }
        let baseline = vol.qos.baseline;
        let t = self.vol_track(idx);
        t.ceiling_in_window = Some(match t.ceiling_in_window {
            Some(c) => c.max(enforced_ceiling),
            None => enforced_ceiling,
        });
        // Obligations under the new QoS start now, with nothing saved up.
        if let Some(m) = &mut t.shadow {
            m.reconfigure(now_ns, baseline);
            m.activate(now_ns);
        }
        if t.head_since_ns.is_some() {
            t.head_since_ns = Some(now_ns);
        }
    }

    /// Records removal of a volume with `dropped` queued requests.
    pub(crate) fn on_remove(&mut self, dropped: usize) {
        self.idle_claim = false;
        self.dropped += dropped as u64;
        self.queued = self.queued.saturating_sub(dropped as u64);
    }

    /// Records a `next()` that returned no dispatch.
    pub(crate) fn on_idle(&mut self, now_ns: u64) {
        self.last_next_ns = now_ns;
        self.idle_claim = true;
    }

    /// The node pacer may save up `depth_ns` of capacity: a window may then hold that much more.
    pub(crate) fn allow_pacer_depth(&mut self, depth_ns: u64) {
        self.pacer_depth_ns = depth_ns;
        self.update_cap_per_window();
    }

    fn update_cap_per_window(&mut self) {
        self.cap_per_window = self.window_capacity.mul_ratio_ceil(
            self.window_ns
                .saturating_add(self.pacer_depth_ns)
                .saturating_add(1),
            NS_PER_S,
        );
    }

    /// The capacity check of window `w`: what it dispatched against its capacity plus what
    /// the pacer saved up and three requests (see [`Tracker::on_dispatch`]).
    fn check_capacity(&mut self, w: u64) {
        let cap_window = self
            .cap_per_window
            .saturating_add(self.max_cost_per_req)
            .saturating_add(self.max_cost_per_req)
            .saturating_add(self.max_cost_per_req);
        if let Some(d) = self.cost_in_window.first_exceeding(&cap_window) {
            self.violate(
                "capacity",
                format!(
                    "window {w}: dispatched {} {} > capacity per window + three requests {}",
                    self.cost_in_window.get(d),
                    d.as_str(),
                    cap_window.get(d)
                ),
            );
        }
    }

    /// Moves the capacity accounting to the (aligned) window holding `now_ns`, if it is not
    /// there yet: nothing dispatched in it so far, and the capacity in effect now was in
    /// effect at its start (every change rolls the window first).
    fn roll_window(&mut self, now_ns: u64) {
        if now_ns < self.window_end_ns {
            return;
        }
        self.window_idx = now_ns / self.window_ns;
        self.window_end_ns = self
            .window_idx
            .saturating_add(1)
            .saturating_mul(self.window_ns);
        self.cost_in_window = CostVector::ZERO;
        if self.window_capacity != self.capacity {
            self.window_capacity = self.capacity;
            self.update_cap_per_window();
        }
    }

    /// Records that the policy schedules over `capacity` from `now_ns` on. O(1).
    ///
    /// - Capacity per window: the window holding `now_ns` is checked against the largest
    ///   capacity in effect during it (per dimension): its pacer refilled at the old rate up to
    ///   `now_ns` and at the new one after, and kept its level, so it admitted at most that.
    /// - Baseline guarantee: checked only while the capacity covers the baselines (as before);
    ///   after a period in which it did not, obligations start again when it does, with what
    ///   the volumes fell behind forgiven (see [`Tracker::check_baseline`]).
    pub(crate) fn on_capacity_change(&mut self, now_ns: u64, capacity: CostVector) {
        self.idle_claim = false;
        if capacity == self.capacity {
            return;
        }
        self.roll_window(now_ns);
        if self.capacity_changes.len() == CAPACITY_HISTORY
            && let Some((t, before)) = self.capacity_changes.pop_front()
        {
            self.older_changes = Some(match self.older_changes {
                Some((_, floor)) => (t, floor.min(before)),
                None => (t, before),
            });
        }
        self.capacity_changes.push_back((now_ns, self.capacity));
        self.capacity = capacity;
        let widest = self.window_capacity.max(capacity);
        if widest != self.window_capacity {
            self.window_capacity = widest;
            self.update_cap_per_window();
        }
    }

    /// Records a dispatch and checks the capacity and ceiling invariants for the current window.
    /// `vol.queue` must already have the request popped (the caller records `vol.stats`).
    pub(crate) fn on_dispatch(
        &mut self,
        now_ns: u64,
        idx: u32,
        vol: &VolCore,
        req: &IoRequest,
        charge: Charge,
        enforced_ceiling: IoRate,
    ) {
        self.last_next_ns = now_ns;
        self.idle_claim = false;
        self.dispatched += 1;
        self.queued = self.queued.saturating_sub(1);

        // Capacity per window (aligned windows; the largest capacity in effect during the
        // window), plus what the pacer saved up (one request, or its depth: see `Pacer`), one
        // (largest) request and one baseline request, plus one nanosecond of capacity (rounding).
        self.roll_window(now_ns);
        let w = self.window_idx;
        self.cost_in_window += req.cost;
        self.max_cost_per_req = self.max_cost_per_req.max(req.cost);
        // Within the capacity per window alone it is within the bound (which only adds to
        // it): the bound is built only for a window that has gone past that, not per dispatch.
        if !self.cost_in_window.fits_within(&self.cap_per_window) {
            self.check_capacity(w);
        }

        if !self.per_volume {
            return;
        }
        // Ceiling per window, plus the limiter's depth (at least one unit) and one request.
        let (window_ns, depth_ns) = (self.window_ns, self.depth_ns);
        let t = self.vol_track(idx);
        t.in_flight += 1;
        t.max_units_per_req = t.max_units_per_req.max(charge.units);
        t.max_bytes_per_req = t.max_bytes_per_req.max(charge.bytes);
        t.max_cost_per_req = t.max_cost_per_req.max(req.cost);
        if w != t.window_idx {
            t.window_idx = w;
            t.units_in_window = 0;
            t.bytes_in_window = 0;
            t.ceiling_in_window = None;
        }
        let ceiling = match t.ceiling_in_window {
            Some(c) => c.max(enforced_ceiling),
            None => enforced_ceiling,
        };
        t.ceiling_in_window = Some(ceiling);
        t.units_in_window += charge.units;
        t.bytes_in_window += charge.bytes;
        let (units_per_window, bytes_per_window) = match t.ceiling_bound {
            Some((c, u, b)) if c == ceiling => (u, b),
            _ => {
                let span = window_ns + depth_ns + 1;
                let u = per_window(ceiling.iops, span);
                let b = per_window(ceiling.bytes_per_s, span);
                t.ceiling_bound = Some((ceiling, u, b));
                (u, b)
            }
        };
        let max_units = units_per_window
            .saturating_add(1)
            .saturating_add(t.max_units_per_req);
        let max_bytes = bytes_per_window
            .saturating_add(1)
            .saturating_add(t.max_bytes_per_req);
        let exceeded = (t.units_in_window > max_units || t.bytes_in_window > max_bytes)
            .then_some((t.units_in_window, t.bytes_in_window));

        // Baseline bookkeeping.
        let max_units_req = t.max_units_per_req;
        let max_bytes_req = t.max_bytes_per_req;
        if let Some(m) = &mut t.shadow {
            m.take(now_ns, charge, max_units_req, max_bytes_req);
        }
        t.head_since_ns = if vol.queue.is_empty() {
            None
        } else {
            Some(now_ns)
        };
        if let Some((units, bytes)) = exceeded {
            let detail = format!(
                "volume {} window {w}: {units} units / {bytes} bytes > ceiling bound {max_units} / {max_bytes}",
                vol.id
            );
            self.violate("ceiling", detail);
        }
    }

    /// Records a completion of a request of `volume` (looked up in `vols` only when per-volume
    /// tracking is on: untracked, a completion is O(1) and never touches the volume).
    pub(crate) fn on_complete<T>(&mut self, vols: &Slab<T>, volume: VolumeId) {
        self.idle_claim = false;
        if !self.per_volume {
            return;
        }
        if let Some(idx) = vols.lookup(volume)
            && vols.get(idx).is_some()
        {
            let t = self.vol_track(idx);
            t.in_flight = t.in_flight.saturating_sub(1);
        }
    }

    /// Common checks: recorded violations, request accounting.
    pub(crate) fn check_common(&self, queued_now: usize) -> Result<(), InvariantViolation> {
        if let Some(v) = &self.first_violation {
            return Err(v.clone());
        }
        if self.queued != queued_now as u64
            || self.enqueued != self.dispatched + self.dropped + self.queued
        {
            return Err(InvariantViolation {
                policy: self.policy,
                invariant: "accounting",
                detail: format!(
                    "enqueued {} != dispatched {} + dropped {} + queued {} (queues hold {})",
                    self.enqueued, self.dispatched, self.dropped, self.queued, queued_now
                ),
            });
        }
        Ok(())
    }

    /// Baseline guarantee: a queued request that is within its volume's baseline (the shadow
    /// meter would admit it) is dispatched within one window, plus the node time of one
    /// request per volume (round robin among baseline requests, and the one request that may
    /// hold the node), of becoming so. Only meaningful if the node is not over-provisioned,
    /// which `baseline_need` and `covers` check with the worst request cost seen per volume.
    ///
    /// When the capacity changes (the node moves capacity between workers), the check applies
    /// while the capacity in effect now covers the baselines; a request is then owed its
    /// baseline from the last change that ended a capacity that did not cover them (what the
    /// volumes fell behind while the node was over-provisioned is forgiven), and the node time
    /// of a request in its grace is that of the smallest capacity in effect since it became
    /// due (a debt left at a higher capacity is repaid at the lower one). Changes older
    /// than the last [`CAPACITY_HISTORY`] are judged by their smallest capacity together, so
    /// a forgiven period may start later than it should (never a false violation).
    ///
    /// Needs the per-volume shadow meters: with per-volume tracking off this check is skipped
    /// (as is the per-volume ceiling check in `on_dispatch`).
    pub(crate) fn check_baseline(
        &self,
        vols: &[(u32, &VolCore)],
        reserve_permille: u64,
    ) -> Result<(), InvariantViolation> {
        if !self.per_volume {
            return Ok(());
        }
        let empty = VolTrack::default();
        let track = |idx: u32| self.vols.get(idx as usize).unwrap_or(&empty);
        let Some(need) = baseline_need(vols.iter().map(|&(idx, v)| (v, track(idx)))) else {
            return Ok(());
        };
        if !covers(&need, self.capacity, reserve_permille) {
            return Ok(());
        }
        // The last change that ended a capacity that did not cover the baselines.
        let owed_from = self
            .capacity_changes
            .iter()
            .rev()
            .find(|(_, before)| !covers(&need, *before, reserve_permille))
            .map(|&(t, _)| t)
            .or_else(|| {
                self.older_changes
                    .filter(|(_, floor)| !covers(&need, *floor, reserve_permille))
                    .map(|(t, _)| t)
            })
            .unwrap_or(0);
        let now = self.last_next_ns;
        let competitors = vols.len() as u64 + 1;
        // One window plus the node time of one request per competitor at `capacity`.
        let grace_at = |capacity: CostVector| {
            let hol_ns = self
                .max_cost_per_req
                .dims()
                .iter()
                .zip(capacity.dims())
                .map(|(&c, cap)| {
                    if cap == u64::MAX {
                        0
                    } else {
                        mul_div_ceil(c, NS_PER_S, cap.max(1))
                    }
                })
                .max()
                .unwrap_or(0);
            self.window_ns
                .saturating_add(hol_ns.saturating_mul(competitors))
        };
        let grace_now = grace_at(self.capacity);
        for &(idx, vol) in vols {
            let t = track(idx);
            let (Some(since), Some(meter), Some(head)) =
                (t.head_since_ns, &t.shadow, vol.queue.front())
            else {
                continue;
            };
            let eligible = meter
                .ready_at(since, Charge::of(&vol.qos, head))
                .max(since)
                .max(owed_from);
            if eligible == u64::MAX || now <= eligible.saturating_add(grace_now) {
                continue;
            }
            // The node time of a request is that of the smallest capacity in effect since the
            // request became eligible (a debt left at a higher capacity is repaid at it).
            let grace_ns = grace_at(self.smallest_capacity_since(eligible));
            if now > eligible.saturating_add(grace_ns) {
                return Err(InvariantViolation {
                    policy: self.policy,
                    invariant: "baseline",
                    detail: format!(
                        "volume {}: head request within baseline since {eligible} ns still queued at {now} ns (grace {grace_ns} ns)",
                        vol.id
                    ),
                });
            }
        }
        Ok(())
    }

    /// The smallest capacity (per dimension) in effect at any time from `t_ns` to now; where
    /// changes were folded (`older_changes`), possibly smaller.
    fn smallest_capacity_since(&self, t_ns: u64) -> CostVector {
        let mut floor = self.capacity;
        for &(at, before) in self.capacity_changes.iter().rev() {
            if at <= t_ns {
                return floor;
            }
            floor = floor.min(before);
        }
        match self.older_changes {
            Some((at, before)) if at > t_ns => floor.min(before),
            _ => floor,
        }
    }

    pub(crate) fn violation(&self, invariant: &'static str, detail: String) -> InvariantViolation {
        InvariantViolation {
            policy: self.policy,
            invariant,
            detail,
        }
    }
}

/// Per-volume invariant bookkeeping.
#[derive(Clone, Debug, Default)]
pub(crate) struct VolTrack {
    window_idx: u64,
    units_in_window: u64,
    bytes_in_window: u64,
    /// Highest enforced ceiling in force during the current window.
    ceiling_in_window: Option<IoRate>,
    /// Cached `(ceiling, units per window span, bytes per window span)`.
    ceiling_bound: Option<(IoRate, u64, u64)>,
    max_units_per_req: u64,
    max_bytes_per_req: u64,
    max_cost_per_req: CostVector,
    /// When the current head request became the head (or its QoS last changed).
    head_since_ns: Option<u64>,
    /// What the volume's baseline alone would allow: a one-unit-deep meter at the baseline,
    /// charged for every dispatch, whose debt is capped at one request (service above the
    /// baseline does not postpone later baseline obligations).
    shadow: Option<ShadowMeter>,
    pub(crate) in_flight: u64,
}

/// A baseline meter for invariant checks (see `VolTrack::shadow`).
#[derive(Clone, Debug)]
pub(crate) struct ShadowMeter {
    iops: TokenBucket,
    bytes: TokenBucket,
    depth_ns: u64,
}

impl ShadowMeter {
    fn new(now_ns: u64, baseline: IoRate, depth_ns: u64) -> Self {
        ShadowMeter {
            iops: TokenBucket::new_limiter(
                now_ns,
                baseline.iops,
                depth_units(baseline.iops, depth_ns),
                1,
            ),
            bytes: TokenBucket::new_limiter(
                now_ns,
                baseline.bytes_per_s,
                depth_units(baseline.bytes_per_s, depth_ns),
                1,
            ),
            depth_ns,
        }
    }

    fn activate(&mut self, now_ns: u64) {
        self.iops.cap_level(now_ns, 1);
        self.bytes.cap_level(now_ns, 1);
    }

    fn reconfigure(&mut self, now_ns: u64, baseline: IoRate) {
        let d = self.depth_ns;
        self.iops
            .reconfigure(now_ns, baseline.iops, depth_units(baseline.iops, d));
        self.bytes.reconfigure(
            now_ns,
            baseline.bytes_per_s,
            depth_units(baseline.bytes_per_s, d),
        );
    }

    /// When the baseline alone would admit `charge`; never if the baseline is zero in a
    /// dimension the request uses (nothing is guaranteed there).
    fn ready_at(&self, now_ns: u64, charge: Charge) -> u64 {
        if self.iops.rate_per_s() == 0 || (charge.bytes > 0 && self.bytes.rate_per_s() == 0) {
            return u64::MAX;
        }
        let a = self.iops.ready_at(now_ns, charge.units);
        let b = if charge.bytes == 0 {
            now_ns
        } else {
            self.bytes.ready_at(now_ns, charge.bytes)
        };
        a.max(b)
    }

    fn take(&mut self, now_ns: u64, charge: Charge, max_units: u64, max_bytes: u64) {
        self.iops.take(now_ns, charge.units);
        self.iops.limit_debt(max_units);
        if charge.bytes > 0 {
            self.bytes.take(now_ns, charge.bytes);
            self.bytes.limit_debt(max_bytes);
        }
    }
}

/// Ceil of `rate_per_s × window_ns / 1 s`, saturating.
pub(crate) fn per_window(rate_per_s: u64, window_ns: u64) -> u64 {
    mul_div_ceil(rate_per_s, window_ns, NS_PER_S)
}

/// How many capacity changes the tracker remembers one by one (see `Tracker::check_baseline`).
const CAPACITY_HISTORY: usize = 16;

/// The sum of baselines per second, at the worst cost per request seen for each volume (a
/// volume that has seen no request costs nothing yet); `None` if no capacity covers it (an
/// unlimited baseline).
fn baseline_need<'a>(vols: impl Iterator<Item = (&'a VolCore, &'a VolTrack)>) -> Option<[u128; 4]> {
    let mut need = [0u128; 4];
    for (v, track) in vols {
        let b = v.qos.baseline;
        if b.iops == 0 && b.bytes_per_s == 0 {
            continue;
        }
        if b.iops == u64::MAX {
            return None;
        }
        // Requests per second at the baseline, at most baseline.iops (each at least one unit).
        let cost = track.max_cost_per_req.dims();
        for (n, c) in need.iter_mut().zip(cost) {
            *n += u128::from(b.iops) * u128::from(c);
        }
    }
    Some(need)
}

/// Whether `need` (see [`baseline_need`]) fits `capacity` minus the reserve: the node is not
/// over-provisioned.
fn covers(need: &[u128; 4], capacity: CostVector, reserve_permille: u64) -> bool {
    capacity.dims().iter().zip(need).all(|(&cap, &n)| {
        let usable = u128::from(cap) * u128::from(1000 - reserve_permille.min(1000)) / 1000;
        cap == u64::MAX || n <= usable
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::OpKind;

    fn one_unit(id: u64) -> IoRequest {
        IoRequest {
            id,
            volume: 0,
            op: OpKind::Read,
            offset_bytes: 0,
            len_bytes: 4096,
            cost: CostVector {
                cpu_ns: 0,
                ingress_bytes: 0,
                egress_bytes: 0,
                device_units: 1,
            },
            arrival_ns: 0,
        }
    }

    /// Ten device units per second over one-second windows: a window holds 11 (the rounding
    /// allowance) plus three requests, 14 one-unit requests; the 15th is a violation.
    #[test]
    fn a_window_past_its_capacity_and_three_requests_is_a_capacity_violation() {
        let capacity = CostVector {
            cpu_ns: u64::MAX,
            ingress_bytes: u64::MAX,
            egress_bytes: u64::MAX,
            device_units: 10,
        };
        let mut tracker = Tracker::new("test", NS_PER_S, capacity, 0, false);
        let vol = VolCore::new(0, VolumeQos::default());
        for id in 0..15 {
            let req = one_unit(id);
            assert!(
                tracker.first_violation.is_none(),
                "violation after {id} requests"
            );
            tracker.on_enqueue(0, 0, &vol);
            let charge = Charge::of(&vol.qos, &req);
            tracker.on_dispatch(1, 0, &vol, &req, charge, IoRate::UNLIMITED);
        }
        let violation = tracker
            .first_violation
            .expect("the 15th request is past the bound");
        assert_eq!(violation.invariant, "capacity");
        assert!(
            violation.detail.contains("dispatched 15"),
            "{}",
            violation.detail
        );
    }
}
