//! Burst: a reconstruction of BurstCBS's burstable I/O scheduler (docs/background.md §1.4, Algorithm 1).
//!
//! Goal: WildCBS's burst throughput with BaseCBS's protection of base-level volumes.
//!
//! Mechanics, per worker:
//! - **Baseline first.** A request within its volume's baseline (the baseline meter allows it)
//!   is served before any burst request and needs only the node pacer (capacity). With the
//!   node not over-provisioned this is what guarantees every baseline.
//! - **Usage monitor and prediction.** Every window (`window_ns`) each active volume's
//!   consumed cost vector is pushed into a ring of the last N windows. The next window's
//!   allocation (Algorithm 1, round 1) is the baseline cost for a volume that burst or was
//!   throttled in the last window, else `min(mean of the last N windows × α, baseline cost)`.
//! - **Lending** (round 2). What capacity is left after round 1 and the reserve is lent to
//!   volumes that may burst, in proportion to `usage + throttled × w_throttle` (dominant-share
//!   scalar of the cost vectors), each capped at its burst ceiling's cost.
//! - **Admission per dimension.** A burst request runs from the volume's lent tokens if its
//!   whole cost vector fits (class *lent*), else from unallocated spare (class *spare*, counted
//!   as throttled); both classes also pass a *burst pacer* at `capacity × (1 − reserve)`, so the
//!   reserve is never used for bursting and the node stays work-conserving apart from it.
//! - **Fast recovery.** When a baseline request pushes its volume's consumption above its
//!   allocation (the prediction was low: the volume woke up), the missing tokens are taken at
//!   once from the unlent pool, then from a donor picked by power of two choices among the
//!   volumes that were lent tokens (the one with more unused lent tokens gives), then from the
//!   reserve. The next window's round 1 gives it its full baseline back.
//!
//! Per-window work iterates over *active* volumes only (queued requests or usage in the last N
//! windows), with fixed-point arithmetic, so it grows with active, not defined, volumes.
//! Exact values BurstCBS did not publish (window, N, α, w_throttle) are parameters; see
//! `docs/qos.md` for the defaults and the measurement behind them.
//!
//! This module holds the per-request rules (the [`Rules`] impl: classify, charge, class gates,
//! checks) and the state they share with the allocation; the per-window allocation itself
//! (rounds 1 and 2, the close-window pass) and fast recovery are in [`allocation`].

mod allocation;
#[cfg(any(test, feature = "bench-support"))]
mod bench;

use super::{SparseCredits, credit_phase, promote_within_baseline};
use crate::cost::CostVector;
use crate::engine::{Ctx, Entry, Place, Rules, Tick, Verdict};
use crate::limiter::{Charge, Pacer, RateLimiter};
use crate::policy::PolicyParams;
use crate::rng::XorShift64;
use crate::sched::{Slab, VolCore};
use crate::vocab::{BurstMode, IoRate, NodeCapacity, Phase, VolumeQos};
use allocation::{AllocSummary, Derived, Donor, Lender};

/// Drives the allocation alone, for the benchmark (feature `bench-support`).
#[cfg(feature = "bench-support")]
pub(crate) use bench::AllocationBench;

const BASELINE: usize = 0;
const LENT: usize = 1;
const SPARE: usize = 2;

/// Per-volume window and allocation state, kept dense in the rules so the per-window loop
/// touches one contiguous array and never the volume table.
///
/// `repr(C)` fixes the field order by temperature: the first three cache lines hold all that
/// an I/O reads or writes (`classify`, `charge`, `observe`), the last two what only the
/// per-window loop adds and the configuration it reads when costs are recomputed. With
/// thousands of volumes each I/O lands on a cache-cold volume, so this bounds its misses here
/// to three lines. Line 0 holds what round 2 (lending) reads and writes (the allocation and
/// the burst cost that caps the loan), so that pass touches one line per volume, and pass 1
/// (lines 1–3, and 0 and 4 only when the costs are recomputed) does not touch it. How many
/// tokens each volume was lent is kept apart, dense, in `BurstRules::donors`.
#[derive(Clone, Debug, Default)]
#[repr(C, align(64))]
struct WinState {
    // Line 0: the volume's tokens this window, and the cost of its burst ceiling.
    alloc: CostVector,
    /// Cost per window at the burst ceiling with the average request (see `base_cost`).
    burst_cost: CostVector,
    // Line 1: usage this window.
    consumed: CostVector,
    throttled: CostVector,
    // Line 2.
    avg_cost: CostVector,
    avg_units_milli: u64,
    avg_bytes: u64,
    /// Requests observed, modulo 256 (only its value modulo 16 is used).
    observations: u8,
    /// A burst request ran this window.
    burst_seen: bool,
    live: bool,
    active: bool,
    in_list: bool,
    backlogged: bool,
    in_spare: bool,
    may_burst: bool,
    costs_stale: bool,
    has_avg: bool,
    last_bursting: bool,
    last_throttled: bool,
    /// `BurstRules::cap_epoch` when `base_cost` and `burst_cost` were computed (they are
    /// capped at one window of capacity, so a capacity change makes them stale).
    cost_epoch: u32,
    // Line 3: per-window only.
    hist_sum: CostVector,
    /// Cost per window at the baseline with the average request, recomputed (with
    /// `burst_cost`) when the average has moved (`costs_stale`).
    base_cost: CostVector,
    // Line 4: the configuration read when costs are recomputed.
    baseline: IoRate,
    burst_ceiling: IoRate,
}

impl WinState {
    fn fresh(&self) -> WinState {
        WinState {
            in_list: self.in_list,
            ..WinState::default()
        }
    }

    fn configure(&mut self, qos: &VolumeQos) {
        self.live = true;
        self.costs_stale = true;
        self.baseline = qos.baseline;
        self.burst_ceiling = qos.burst_ceiling();
        self.may_burst = qos.burst != BurstMode::None;
    }

    /// Pushes one window's usage into the volume's history ring: `entry` is its entry at the
    /// ring's current position (see `BurstRules::hist`), holding the usage of N windows ago.
    fn push_history(&mut self, entry: Option<&mut CostVector>, usage: CostVector) {
        let Some(old) = entry else {
            return;
        };
        self.hist_sum = self.hist_sum.saturating_sub(*old).saturating_add(usage);
        *old = usage;
    }

    /// Leaves the active list: no allocation, nothing counted.
    fn leave_list(&mut self) {
        self.active = false;
        self.in_list = false;
        self.alloc = CostVector::ZERO;
        self.consumed = CostVector::ZERO;
        self.throttled = CostVector::ZERO;
        self.burst_seen = false;
    }

    fn tokens_left(&self) -> CostVector {
        self.alloc.saturating_sub(self.consumed)
    }

    fn observe(&mut self, charge: Charge, cost: &CostVector) {
        let units_milli = charge.units.saturating_mul(1000);
        // The window costs follow the average; refreshing them every 16 requests (and at
        // the first) keeps the per-window loop cheap while tracking the request mix.
        self.observations = self.observations.wrapping_add(1);
        if self.observations % 16 == 1 {
            self.costs_stale = true;
        }
        if !self.has_avg {
            self.avg_cost = *cost;
            self.avg_units_milli = units_milli;
            self.avg_bytes = charge.bytes;
            self.has_avg = true;
            return;
        }
        // EWMA with gain 1/8.
        self.avg_cost = self.avg_cost.zip(*cost, ewma);
        self.avg_units_milli = ewma(self.avg_units_milli, units_milli);
        self.avg_bytes = ewma(self.avg_bytes, charge.bytes);
    }
}

fn ewma(avg: u64, x: u64) -> u64 {
    if x >= avg {
        avg + (x - avg) / 8
    } else {
        avg - (avg - x) / 8
    }
}

#[derive(Debug)]
pub(crate) struct BurstRules {
    window_ns: u64,
    depth_ns: u64,
    history_windows: usize,
    alpha_permille: u64,
    throttle_weight_permille: u64,
    reserve_permille: u64,
    cap_window: CostVector,
    reserve_window: CostVector,
    /// The largest `cap_window` in effect during the current window (per dimension): what its
    /// allocation, pool and reserve may add up to (`check`).
    alloc_cap_window: CostVector,
    /// Bumped by every capacity change: window costs computed before it are stale.
    cap_epoch: u32,
    /// `2^FP / cap_window` per dimension (0 where the dimension is unlimited).
    inv_cap_window: [u64; 4],
    window_idx: u64,
    next_window_ns: u64,
    burst_pacer: Pacer,
    slots: Vec<WinState>,
    /// Usage history of every slot, `history_windows` planes of `hist_stride` entries: entry
    /// `p * hist_stride + idx` is slot `idx`'s usage at ring position `p`. One ring position
    /// (`hist_pos`) serves every volume: all listed volumes push once per window (and the same
    /// number of zeros after a gap), and a volume joins the list with an all-zero history
    /// (new, reset, or it left idle and was zeroed), so each volume's entry at the shared
    /// position is its own usage of N pushes ago, as with a ring per volume. A window's pushes
    /// then all land in one plane, densely, instead of one cache line per volume (in a busy
    /// simulated node the oldest entry was a cache miss per volume per window).
    /// Flat, so the per-window loop does not chase one heap pointer per volume.
    hist: Vec<CostVector>,
    /// Entries per plane of `hist` (a power of two, at least the number of slots).
    hist_stride: usize,
    /// The ring position the next window's push goes to.
    hist_pos: usize,
    /// The active list: one bit per slot, set while the slot is listed (`WinState::in_list`).
    /// The allocation walks it in slot order, so its pass streams through the volumes' state
    /// and history planes instead of jumping to wherever each volume's state lies (a list in
    /// the order volumes became active is random in a busy node, and between two windows the
    /// I/O path evicts that state: in the simulated hour, walking a list of 125 volumes per
    /// worker missed on every volume's history entry).
    listed: Vec<u64>,
    /// One bit per word of `listed`, set while that word is not zero: the walk skips empty
    /// stretches 4,096 slots at a time, so it grows with active, not defined, volumes.
    listed_words: Vec<u64>,
    /// Bits set in `listed`.
    listed_count: usize,
    /// Volumes that may be lent tokens this window, in slot order (scratch of `allocate`).
    lenders: Vec<Lender>,
    /// Volumes lent tokens this window, in slot order (recovery picks them by position).
    donors: Vec<Donor>,
    pool_left: CostVector,
    reserve_left: CostVector,
    rng: XorShift64,
    /// The vector level the allocation runs at (detected; lowered by tests and benches).
    pub(crate) cpu: crate::cpu::CpuLevel,
    pub(crate) last_alloc: AllocSummary,
    recoveries: u64,
}

impl BurstRules {
    pub(crate) fn new(capacity: NodeCapacity, params: &PolicyParams) -> Self {
        let window_ns = params.window_ns;
        // Below 1000 (as `build_policy` clamps it), so the burst rate is well defined.
        let reserve = u64::from(params.reserve_permille).min(999);
        let Derived {
            cap_window,
            reserve_window,
            burst_rate,
            inv_cap_window,
        } = Derived::of(capacity, window_ns, reserve);
        BurstRules {
            window_ns,
            depth_ns: params.limiter_depth_ns,
            // At most 1,024 (as `build_policy` clamps it): positions fit `BurstRules::hist_pos`.
            history_windows: params.history_windows.clamp(1, 1024) as usize,
            alpha_permille: u64::from(params.alpha_permille),
            throttle_weight_permille: u64::from(params.throttle_weight_permille),
            reserve_permille: reserve,
            cap_window,
            reserve_window,
            alloc_cap_window: cap_window,
            cap_epoch: 0,
            inv_cap_window,
            window_idx: 0,
            next_window_ns: window_ns,
            burst_pacer: Pacer::with_depth(0, burst_rate, params.limiter_depth_ns.max(1)),
            slots: Vec::new(),
            hist: Vec::new(),
            hist_stride: 0,
            hist_pos: 0,
            listed: Vec::new(),
            listed_words: Vec::new(),
            listed_count: 0,
            lenders: Vec::new(),
            donors: Vec::new(),
            pool_left: cap_window.saturating_sub(reserve_window),
            reserve_left: reserve_window,
            rng: XorShift64::new(params.seed),
            cpu: crate::cpu::CpuLevel::detect(),
            last_alloc: AllocSummary::default(),
            recoveries: 0,
        }
    }

    /// Whether volume `idx` is bursting: it ran a burst request this window or the last. Its
    /// baseline requests then get no node pacer allowance and are charged to the burst pacer.
    fn bursting(&self, idx: u32) -> bool {
        self.slots
            .get(idx as usize)
            .is_some_and(|st| st.burst_seen || st.last_bursting)
    }

    fn slot(&mut self, idx: u32) -> &mut WinState {
        let i = idx as usize;
        if self.slots.len() <= i {
            self.slots.resize_with(i + 1, WinState::default);
            if self.slots.len() > self.hist_stride {
                self.grow_history(self.slots.len());
            }
            self.listed.resize(self.slots.len().div_ceil(64), 0);
            self.listed_words.resize(self.listed.len().div_ceil(64), 0);
        }
        &mut self.slots[i]
    }

    /// Re-lays the history planes out for at least `slots` slots (doubling, so growth is
    /// amortised O(1) per volume).
    fn grow_history(&mut self, slots: usize) {
        let n = self.history_windows;
        let stride = slots.next_power_of_two().max(64);
        let mut hist = vec![CostVector::ZERO; n * stride];
        let old = self.hist_stride;
        if old > 0 {
            for (new_plane, old_plane) in hist
                .chunks_exact_mut(stride)
                .zip(self.hist.chunks_exact(old))
            {
                if let Some(dst) = new_plane.get_mut(..old) {
                    dst.copy_from_slice(old_plane);
                }
            }
        }
        self.hist = hist;
        self.hist_stride = stride;
    }

    /// Zeroes slot `idx`'s history in every plane.
    fn zero_history(&mut self, idx: u32) {
        let stride = self.hist_stride;
        for p in 0..self.history_windows {
            if let Some(e) = self.hist.get_mut(p * stride + idx as usize) {
                *e = CostVector::ZERO;
            }
        }
    }

    /// Resets a slot for a new (or removed) volume, history included.
    fn reset_slot(&mut self, idx: u32) {
        self.cancel_loan(idx);
        let st = self.slot(idx);
        *st = st.fresh();
        self.zero_history(idx);
    }
}

#[cfg(test)]
fn bit(bits: &[u64], idx: u32) -> bool {
    bits.get(idx as usize / 64)
        .is_some_and(|w| w & (1u64 << (idx % 64)) != 0)
}

fn set_bit(bits: &mut [u64], idx: u32, on: bool) {
    if let Some(w) = bits.get_mut(idx as usize / 64) {
        if on {
            *w |= 1u64 << (idx % 64);
        } else {
            *w &= !(1u64 << (idx % 64));
        }
    }
}

#[derive(Debug)]
pub(crate) struct BurstVol {
    ceiling: RateLimiter,
    meter: RateLimiter,
    credits: SparseCredits,
}

impl Rules for BurstRules {
    type Vol = BurstVol;

    fn name(&self) -> &'static str {
        "burst"
    }

    fn classes(&self) -> usize {
        3
    }

    fn new_vol(&mut self, now_ns: u64, idx: u32, qos: &VolumeQos) -> BurstVol {
        self.reset_slot(idx);
        self.slot(idx).configure(qos);
        BurstVol {
            ceiling: RateLimiter::new(now_ns, qos.burst_ceiling(), self.depth_ns),
            meter: RateLimiter::new(now_ns, qos.baseline, self.depth_ns),
            credits: SparseCredits::new(now_ns, qos),
        }
    }

    fn reconfigure(&mut self, now_ns: u64, idx: u32, qos: &VolumeQos, vol: &mut BurstVol) {
        vol.ceiling.reconfigure(now_ns, qos.burst_ceiling());
        vol.meter.reconfigure(now_ns, qos.baseline);
        vol.credits.reconfigure(now_ns, qos);
        self.slot(idx).configure(qos);
    }

    fn removed(&mut self, _now_ns: u64, idx: u32, _vol: &BurstVol) {
        self.reset_slot(idx);
    }

    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate {
        qos.burst_ceiling()
    }

    fn became_backlogged(&mut self, _now_ns: u64, idx: u32, _vol: &mut BurstVol) {
        let st = self.slot(idx);
        st.backlogged = true;
        if !st.active {
            st.active = true;
            if !st.in_list {
                st.in_list = true;
                set_bit(&mut self.listed, idx, true);
                set_bit(&mut self.listed_words, idx / 64, true);
                self.listed_count += 1;
            }
        }
    }

    fn classify(
        &mut self,
        now_ns: u64,
        idx: u32,
        core: &VolCore,
        vol: &mut BurstVol,
        charge: Charge,
        cost: &CostVector,
    ) -> Place {
        let t_ok = vol
            .ceiling
            .ready_at(now_ns, charge)
            .max(vol.credits.ready_at(now_ns, charge));
        if t_ok > now_ns {
            self.slot(idx).in_spare = false;
            return Place::At(t_ok);
        }
        let t_meter = vol.meter.ready_at(now_ns, charge);
        let st = self.slot(idx);
        if t_meter <= now_ns || core.burst_none {
            st.in_spare = false;
            return Place::Ring {
                class: BASELINE,
                front: false,
                reclassify_at: None,
            };
        }
        let class = if cost.fits_within(&st.tokens_left()) {
            LENT
        } else {
            SPARE
        };
        st.in_spare = class == SPARE;
        Place::Ring {
            class,
            front: false,
            reclassify_at: Some(t_meter),
        }
    }

    fn is_baseline_class(&self, class: usize) -> bool {
        class == BASELINE
    }

    fn baseline_allowance(&self, _now_ns: u64, idx: u32, _vol: &BurstVol) -> bool {
        !self.bursting(idx)
    }

    fn effective_class(&self, now_ns: u64, class: usize, vol: &BurstVol, charge: Charge) -> usize {
        promote_within_baseline(class, BASELINE, &vol.meter, now_ns, charge)
    }

    fn class_gate(&self, now_ns: u64, class: usize, cost: &CostVector) -> u64 {
        if class == BASELINE {
            now_ns
        } else {
            self.burst_pacer.ready_at(now_ns, cost, false)
        }
    }

    fn class_blocking_dims(&self, now_ns: u64, class: usize, cost: &CostVector) -> u8 {
        if class == BASELINE {
            0
        } else {
            self.burst_pacer.blocking_dims(now_ns, cost, false)
        }
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut BurstVol) -> Verdict {
        // The baseline ring holds a volume whose head `classify` found within its baseline
        // meter (or that may not burst), and it is placed again after anything that takes from
        // the meter, changes its QoS or changes its head; a meter only fills while it waits.
        // So the class answers what `credit_phase` would ask the meter again; a volume promoted
        // by `effective_class` was just found within it.
        let phase = if ctx.class == BASELINE {
            debug_assert_eq!(credit_phase(ctx, &vol.meter, &vol.credits), Phase::Baseline);
            Phase::Baseline
        } else {
            credit_phase(ctx, &vol.meter, &vol.credits)
        };
        Verdict::Run {
            phase,
            front: false,
        }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut BurstVol) {
        let Ctx {
            now_ns,
            idx,
            core,
            charge,
            req,
            ..
        } = *ctx;
        vol.ceiling.take(now_ns, charge);
        vol.credits.take(now_ns, charge);
        let cost = req.cost;
        let bursting = self.bursting(idx);
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        }
        // A bursting volume's baseline requests do not wait for the burst pacer, but they
        // are charged to it: the bursting volumes together stay out of the reserve, which is
        // what keeps the node's queues short for the volumes within their baseline.
        if phase != Phase::Baseline || bursting {
            self.burst_pacer.take(now_ns, &cost);
        }
        let st = self.slot(idx);
        st.observe(charge, &cost);
        let had = st.tokens_left();
        st.consumed = st.consumed.saturating_add(cost);
        if core.queue.is_empty() {
            st.backlogged = false;
        }
        if phase == Phase::Baseline {
            if !cost.fits_within(&had) {
                self.recover(idx, cost.saturating_sub(had));
            }
        } else {
            st.burst_seen = true;
            if !cost.fits_within(&had) {
                st.throttled = st.throttled.saturating_add(cost);
            }
        }
    }

    fn set_capacity(&mut self, now_ns: u64, capacity: NodeCapacity) {
        let Derived {
            cap_window,
            reserve_window,
            burst_rate,
            inv_cap_window,
        } = Derived::of(capacity, self.window_ns, self.reserve_permille);
        // The current window keeps its allocation (loans included: taking them back would
        // visit every volume); what is not handed out yet shrinks with a smaller capacity and
        // does not grow with a larger one (the burst pacer passes the extra at once).
        let avail = cap_window.saturating_sub(reserve_window);
        self.pool_left = self.pool_left.min(avail);
        self.reserve_left = self.reserve_left.min(reserve_window);
        self.alloc_cap_window = self.alloc_cap_window.max(cap_window);
        self.burst_pacer.set_rate(now_ns, burst_rate);
        self.cap_window = cap_window;
        self.reserve_window = reserve_window;
        self.inv_cap_window = inv_cap_window;
        // The window costs (capped at one window of capacity) are recomputed lazily, by the
        // next allocation that meets each volume.
        self.cap_epoch = self.cap_epoch.wrapping_add(1);
    }

    fn tick(&mut self, now_ns: u64, _vols: &mut Slab<Entry<BurstVol>>) -> Option<Tick> {
        if now_ns < self.next_window_ns {
            return None;
        }
        let w = now_ns / self.window_ns;
        let gap = w - self.window_idx;
        self.window_idx = w;
        self.next_window_ns = w.saturating_add(1).saturating_mul(self.window_ns);
        self.allocate(gap);
        // Fresh tokens: spare-class volumes may be lent ones now; they are corrected at their
        // turn (at most one request each served at the lent class's priority).
        Some(Tick {
            replace: Vec::new(),
            merge: Some((SPARE, LENT)),
        })
    }

    fn restore_credits(
        &mut self,
        now_ns: u64,
        vol: &mut BurstVol,
        iops_credits: Option<u64>,
        bytes_credits: Option<u64>,
    ) -> bool {
        vol.credits.restore(now_ns, iops_credits, bytes_credits)
    }

    fn credits(&self, now_ns: u64, vol: &BurstVol) -> (Option<u64>, Option<u64>) {
        vol.credits.balances_at(now_ns)
    }

    fn check(&self, vols: &Slab<Entry<BurstVol>>) -> Result<(), String> {
        for (_, e) in vols.iter() {
            if !e.x.credits.within_range() {
                return Err(format!(
                    "volume {}: credit balance outside [0, bucket]",
                    e.core.id
                ));
            }
        }
        // Guarantee (i) of BurstCBS: the allocation never exceeds the limit.
        let total = self
            .slots
            .iter()
            .filter(|s| s.active)
            .fold(CostVector::ZERO, |acc, s| acc.saturating_add(s.alloc))
            .saturating_add(self.pool_left)
            .saturating_add(self.reserve_left);
        if let Some(d) = total.first_exceeding(&self.alloc_cap_window) {
            return Err(format!(
                "allocation {} {} + pool + reserve exceeds one window of capacity {} (the largest in effect this window)",
                total.get(d),
                d.as_str(),
                self.alloc_cap_window.get(d)
            ));
        }
        Ok(())
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        Some(0)
    }

    fn must_run(
        &self,
        now_ns: u64,
        core: &VolCore,
        vol: &BurstVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Option<bool> {
        let t_ok = vol
            .ceiling
            .ready_at(now_ns, charge)
            .max(vol.credits.ready_at(now_ns, charge));
        if t_ok > now_ns {
            return Some(false);
        }
        let baseline = core.burst_none || vol.meter.ready_at(now_ns, charge) <= now_ns;
        Some(baseline || self.burst_pacer.idle_at(now_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn win_state_keeps_its_cache_line_layout() {
        assert_eq!(std::mem::size_of::<WinState>(), 5 * 64);
        assert_eq!(std::mem::offset_of!(WinState, consumed), 64);
        assert_eq!(std::mem::offset_of!(WinState, avg_cost), 128);
        assert!(std::mem::offset_of!(WinState, last_throttled) < 192);
        assert_eq!(std::mem::offset_of!(WinState, hist_sum), 192);
        assert_eq!(std::mem::offset_of!(WinState, burst_cost), 32);
        assert_eq!(std::mem::offset_of!(WinState, baseline), 256);
    }
}
