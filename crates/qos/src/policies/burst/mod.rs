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

use super::{SparseCredits, credit_phase, promote_within_baseline};
use crate::cost::CostVector;
use crate::engine::{Ctx, Entry, Place, Rules, Tick, Verdict};
use crate::limiter::{Charge, Pacer, RateLimiter};
use crate::policy::PolicyParams;
use crate::rng::XorShift64;
use crate::sched::{Slab, VolCore};
use crate::vocab::{BurstMode, IoRate, NS_PER_S, NodeCapacity, Phase, VolumeQos};

const BASELINE: usize = 0;
const LENT: usize = 1;
const SPARE: usize = 2;

/// Fixed-point shift for shares and ratios.
const FP: u32 = 32;

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

/// A volume kept in the active list by round 1 of the allocation, gathered densely so that
/// the rescale and round 2 (lending) read one array and write each volume's state once.
#[derive(Clone, Copy, Debug)]
struct Lender {
    idx: u32,
    /// Lending weight (0: may not burst).
    weight: u64,
    /// Its round-1 allocation (after any scaling).
    alloc: CostVector,
}

/// A volume lent tokens this window, and how many (less what recovery has taken back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Donor {
    idx: u32,
    lent: CostVector,
}

/// Summary of the last per-window allocation (for tests, benches and docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AllocSummary {
    pub(crate) active_volumes: usize,
    pub(crate) lenders: usize,
    pub(crate) round1: CostVector,
    pub(crate) lent: CostVector,
}

/// What Burst derives from the capacity it schedules over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Derived {
    /// One window of capacity (`u64::MAX` where unlimited).
    cap_window: CostVector,
    /// The part of it held back for fast recovery.
    reserve_window: CostVector,
    /// Rate of the burst pacer: capacity less the reserve.
    burst_rate: CostVector,
    /// `2^FP / cap_window` per dimension (0 where the dimension is unlimited).
    inv_cap_window: [u64; 4],
}

impl Derived {
    fn of(capacity: NodeCapacity, window_ns: u64, reserve_permille: u64) -> Self {
        let reserve = reserve_permille;
        let cap_window = capacity.per_second.mul_ratio_floor(window_ns, NS_PER_S);
        let cap_window =
            capacity.per_second.zip(
                cap_window,
                |per_s, w| if per_s == u64::MAX { u64::MAX } else { w },
            );
        let reserve_window = cap_window.map(|c| {
            if c == u64::MAX {
                0
            } else {
                c / 1000 * reserve + c % 1000 * reserve / 1000
            }
        });
        let burst_rate = capacity.per_second.map(|c| {
            if c == u64::MAX {
                u64::MAX
            } else {
                crate::cost::mul_div_floor(c, 1000 - reserve, 1000)
            }
        });
        let inv_cap_window = cap_window.dims().map(|c| {
            if c == u64::MAX || c == 0 {
                0
            } else {
                ((1u128 << FP) / u128::from(c)).max(1) as u64
            }
        });
        Derived {
            cap_window,
            reserve_window,
            burst_rate,
            inv_cap_window,
        }
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
            // At most 1,024 (as `build_policy` clamps it): positions fit `WinState::hist_pos`.
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
        // Nothing lent any more (rare: volumes are added and removed, not per I/O).
        if let Some(d) = self.donors.iter_mut().find(|d| d.idx == idx) {
            d.lent = CostVector::ZERO;
        }
        let st = self.slot(idx);
        *st = st.fresh();
        self.zero_history(idx);
    }

    /// Dominant share of a cost vector relative to one window of capacity, fixed point `2^FP`.
    fn dominant_share(&self, v: &CostVector) -> u64 {
        dominant_share(&self.inv_cap_window, v)
    }

    /// Ends the finished window and computes the next window's allocations (Algorithm 1),
    /// compiled for the CPU's vector level (`crate::cpu`: same results at every level).
    fn allocate(&mut self, gap_windows: u64) {
        let level = self.cpu;
        let (rules, gap) = (self, gap_windows);
        crate::cpu::dispatch!(level, |rules: &mut BurstRules, gap: u64| rules
            .allocate_body(gap))
    }

    #[inline(always)]
    fn allocate_body(&mut self, gap_windows: u64) {
        let n = self.history_windows;
        // alpha / N in 2^FP fixed point; alpha_permille is at most u32::MAX, so this fits.
        let alpha_fp: u64 = ((u128::from(self.alpha_permille) << FP) / (1000 * n as u128))
            .min(u128::from(u64::MAX)) as u64;
        self.lenders.clear();
        self.lenders.reserve(self.listed_count);
        // Pass 1: close the window, predict, round 1. One borrow of the slot per volume and the
        // constants in locals, so the loop does no repeated bounds checks or reloads.
        let close = CloseWindow {
            inv_cap: self.inv_cap_window,
            throttle_w: self.throttle_weight_permille,
            cap_window: self.cap_window,
            cap_epoch: self.cap_epoch,
            window_ns: self.window_ns,
            alpha_fp,
            zero_pushes: gap_windows.min(n as u64).saturating_sub(1) as usize,
            pos: self.hist_pos,
            planes: n,
            stride: self.hist_stride,
        };
        let mut acc = Round1 {
            lenders: &mut self.lenders,
            round1: [0; 4],
            sum_weight: 0,
            max_weight: 0,
        };
        // The listed volumes in slot order: the words of `listed` that have a bit set, then
        // their bits. A volume that leaves the list clears its bit (and its word's summary bit
        // when the word empties).
        for sw in 0..self.listed_words.len() {
            let mut words = self.listed_words[sw];
            while words != 0 {
                let w = sw * 64 + words.trailing_zeros() as usize;
                words &= words - 1;
                let Some(&word) = self.listed.get(w) else {
                    continue;
                };
                let mut bits = word;
                let mut left = word;
                while bits != 0 {
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    let idx = w * 64 + b as usize;
                    let kept = match self.slots.get_mut(idx) {
                        Some(st) => acc.close(&close, st, &mut self.hist, idx as u32),
                        None => false,
                    };
                    if !kept {
                        left &= !(1u64 << b);
                        self.listed_count -= 1;
                    }
                }
                self.listed[w] = left;
                if left == 0 {
                    self.listed_words[sw] &= !(1u64 << (w % 64));
                }
            }
        }
        // Every listed volume pushed once and `zero_pushes` zeros: the shared ring moves on.
        self.hist_pos = (close.pos + 1 + close.zero_pushes) % n.max(1);
        let Round1 {
            round1: round1_wide,
            sum_weight,
            max_weight,
            ..
        } = acc;
        // The saturating sum, exactly: a wide sum clamped once.
        let mut round1 =
            CostVector::from_dims(round1_wide.map(|x| x.min(u128::from(u64::MAX)) as u64));
        let avail = self.cap_window.saturating_sub(self.reserve_window);
        // Over-provisioned node: scale round 1 down so the total never exceeds the limit.
        if !round1.fits_within(&avail) {
            let scale: [(u64, u64); 4] =
                std::array::from_fn(|d| (avail.dims()[d], round1.dims()[d]));
            let scaled = |a: CostVector| {
                let a = a.dims();
                CostVector::from_dims(std::array::from_fn(|d| {
                    let (num, den) = scale[d];
                    if den > num {
                        crate::cost::mul_div_floor(a[d], num, den)
                    } else {
                        a[d]
                    }
                }))
            };
            // One pass over the dense copies rescales and re-sums.
            let mut sum = CostVector::ZERO;
            for l in &mut self.lenders {
                l.alloc = scaled(l.alloc);
                sum = sum.saturating_add(l.alloc);
            }
            round1 = sum;
        }
        let left = avail.saturating_sub(round1);
        // Pass 2: lend what is left in proportion to weight, capped at the burst ceiling.
        let per_weight: [u128; 4] = left
            .dims()
            .map(|l| (u128::from(l) << FP).checked_div(sum_weight).unwrap_or(0));
        let mut lent_total = CostVector::ZERO;
        // Gathered in a local (its length stays in a register in the loop).
        let mut donors = std::mem::take(&mut self.donors);
        donors.clear();
        // Each share is at most `weight × left / sum_weight` (both roundings are down), so the
        // shares sum to at most `left` and need no running clamp; `check` verifies the total.
        // The volumes were gathered densely in pass 1, so this pass reads one array and writes
        // one cache line per volume (its allocation and loan, which pass 1 left alone).
        // When the largest weight times every per-weight share fits 64 bits (always, but for
        // absurd capacities), the shares are computed without overflow checks: same values.
        let per_weight_64 = per_weight.map(|p| u64::try_from(p).ok());
        let fast = per_weight_64
            .iter()
            .all(|p| p.is_some_and(|p| max_weight.checked_mul(p).is_some()));
        let pw = per_weight_64.map(|p| p.unwrap_or(0));
        // The slots as one slice: the loop does not reload the vector's pointer and length.
        let slots = &mut self.slots[..];
        for l in &self.lenders {
            let Some(st) = slots.get_mut(l.idx as usize) else {
                continue;
            };
            let extra = if l.weight == 0 {
                CostVector::ZERO
            } else {
                let share = if fast {
                    CostVector::from_dims(pw.map(|p| (l.weight * p) >> FP))
                } else {
                    let w = u128::from(l.weight);
                    CostVector::from_dims(std::array::from_fn(|d| {
                        ((w * per_weight[d]) >> FP).min(u128::from(u64::MAX)) as u64
                    }))
                };
                share.min(st.burst_cost.saturating_sub(l.alloc))
            };
            // `extra` is at most the room left below `burst_cost`: the sum cannot overflow.
            st.alloc = l.alloc.zip(extra, |a, x| a + x);
            if !extra.is_zero() {
                // The loans sum to at most `left` (see above): no overflow.
                lent_total = lent_total.zip(extra, |t, x| t + x);
                donors.push(Donor {
                    idx: l.idx,
                    lent: extra,
                });
            }
        }
        self.donors = donors;
        debug_assert!(lent_total.fits_within(&left));
        self.pool_left = left.saturating_sub(lent_total);
        self.reserve_left = self.reserve_window;
        self.alloc_cap_window = self.cap_window;
        self.last_alloc = AllocSummary {
            active_volumes: self.listed_count,
            lenders: self.donors.len(),
            round1,
            lent: lent_total,
        };
    }

    /// Fast recovery: moves `need` tokens to `idx` from the pool, a power-of-two-choices donor,
    /// then the reserve.
    fn recover(&mut self, idx: u32, mut need: CostVector) {
        self.recoveries += 1;
        let mut got = need.min(self.pool_left);
        self.pool_left = self.pool_left.saturating_sub(got);
        need = need.saturating_sub(got);
        if !need.is_zero() && !self.donors.is_empty() {
            let pa = self.rng.below(self.donors.len());
            let pb = self.rng.below(self.donors.len());
            let (a, b) = (self.donors[pa].idx, self.donors[pb].idx);
            let surplus = |s: &WinState, lent: CostVector| {
                if s.active {
                    lent.min(s.tokens_left())
                } else {
                    CostVector::ZERO
                }
            };
            let (sa, sb) = (
                surplus(&self.slots[a as usize], self.donors[pa].lent),
                surplus(&self.slots[b as usize], self.donors[pb].lent),
            );
            let (donor, pos, avail) =
                if a != idx && (b == idx || self.dominant_share(&sa) >= self.dominant_share(&sb)) {
                    (a, pa, sa)
                } else {
                    (b, pb, sb)
                };
            if donor != idx {
                let moved = need.min(avail);
                let d = &mut self.slots[donor as usize];
                d.alloc = d.alloc.saturating_sub(moved);
                let d = &mut self.donors[pos];
                d.lent = d.lent.saturating_sub(moved);
                got = got.saturating_add(moved);
                need = need.saturating_sub(moved);
            }
        }
        if !need.is_zero() {
            let from_reserve = need.min(self.reserve_left);
            self.reserve_left = self.reserve_left.saturating_sub(from_reserve);
            got = got.saturating_add(from_reserve);
        }
        let st = &mut self.slots[idx as usize];
        st.alloc = st.alloc.saturating_add(got);
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

/// Pass 1's running totals and the lenders it gathers.
struct Round1<'a> {
    lenders: &'a mut Vec<Lender>,
    /// Sum of the round-1 allocations per dimension (wide: cannot overflow).
    round1: [u128; 4],
    sum_weight: u128,
    max_weight: u64,
}

impl Round1<'_> {
    /// Closes the window of one listed volume (see [`CloseWindow::run`]) and adds it to the
    /// totals; false if it leaves the list.
    #[inline(always)]
    fn close(
        &mut self,
        close: &CloseWindow,
        st: &mut WinState,
        hist: &mut [CostVector],
        idx: u32,
    ) -> bool {
        let Some((alloc, weight)) = close.run(st, hist, idx as usize) else {
            return false;
        };
        self.lenders.push(Lender { idx, weight, alloc });
        self.max_weight = self.max_weight.max(weight);
        let a = alloc.dims();
        for (sum, x) in self.round1.iter_mut().zip(a) {
            *sum += u128::from(x);
        }
        self.sum_weight += u128::from(weight);
        true
    }
}

/// Pass 1 of the allocation for one volume, with the window's constants.
struct CloseWindow {
    inv_cap: [u64; 4],
    throttle_w: u64,
    cap_window: CostVector,
    cap_epoch: u32,
    window_ns: u64,
    alpha_fp: u64,
    zero_pushes: usize,
    /// The shared ring position of this window's push, the number of positions (N) and the
    /// entries per plane (see `BurstRules::hist`).
    pos: usize,
    planes: usize,
    stride: usize,
}

impl CloseWindow {
    /// Closes the window of one listed volume: pushes its usage into its history, predicts,
    /// and returns its round-1 allocation (stored by round 2) and its lending weight; `None`
    /// (and the volume marked unlisted) if it leaves the active list.
    #[inline(always)]
    fn run(
        &self,
        st: &mut WinState,
        hist: &mut [CostVector],
        idx: usize,
    ) -> Option<(CostVector, u64)> {
        if !st.live || !st.active {
            // Removed (its history was zeroed then): nothing to push.
            st.leave_list();
            return None;
        }
        let usage = st.consumed;
        st.push_history(hist.get_mut(self.pos * self.stride + idx), usage);
        let mut p = self.pos;
        for _ in 0..self.zero_pushes {
            p += 1;
            if p == self.planes {
                p = 0;
            }
            st.push_history(hist.get_mut(p * self.stride + idx), CostVector::ZERO);
        }
        st.last_bursting = st.burst_seen;
        st.last_throttled = !st.throttled.is_zero();
        if !st.backlogged && st.hist_sum.is_zero() {
            // Idle for N windows: leaves the active list, with an all-zero history (already
            // zero unless a saturated sum hid an entry; rare, so the N stores are cheap).
            for q in 0..self.planes {
                if let Some(e) = hist.get_mut(q * self.stride + idx) {
                    *e = CostVector::ZERO;
                }
            }
            st.leave_list();
            return None;
        }
        if st.costs_stale || st.cost_epoch != self.cap_epoch {
            let (base, burst) = window_costs(st, self.cap_window, self.window_ns);
            st.base_cost = base;
            st.burst_cost = burst;
            st.costs_stale = false;
            st.cost_epoch = self.cap_epoch;
        }
        let base = st.base_cost;
        let alloc = if st.last_bursting || st.last_throttled {
            base
        } else {
            st.hist_sum.map(|s| mul_shr_fp(s, self.alpha_fp)).min(base)
        };
        let weight = if st.may_burst {
            let u = dominant_share(&self.inv_cap, &st.consumed);
            let t = if st.last_throttled {
                dominant_share(&self.inv_cap, &st.throttled)
            } else {
                0
            };
            u.saturating_add(t.saturating_mul(self.throttle_w) / 1000)
                .max(1)
        } else {
            0
        };
        // `alloc` and `lent` are written by round 2 (one line, once).
        st.in_spare = false;
        st.consumed = CostVector::ZERO;
        st.throttled = CostVector::ZERO;
        st.burst_seen = false;
        Some((alloc, weight))
    }
}

/// Dominant share of `v` relative to one window of capacity (`inv_cap` = `2^FP / capacity`
/// per dimension), fixed point `2^FP`.
fn dominant_share(inv_cap: &[u64; 4], v: &CostVector) -> u64 {
    v.dims()
        .iter()
        .zip(inv_cap)
        .map(|(&x, &inv)| x.saturating_mul(inv))
        .max()
        .unwrap_or(0)
}

/// `floor(x × m / 2^FP)`, saturating at `u64::MAX`: 64-bit when the product fits, which it
/// does for every realistic usage, else exact in 128 bits.
fn mul_shr_fp(x: u64, m: u64) -> u64 {
    match x.checked_mul(m) {
        Some(p) => p >> FP,
        None => ((u128::from(x) * u128::from(m)) >> FP).min(u128::from(u64::MAX)) as u64,
    }
}

/// Cost per window of running at the baseline and at the burst ceiling with this volume's
/// average request. Floating point: this is a prediction that sizes a share, never a limit
/// (limits are exact integer buckets), and it keeps the per-window loop free of divisions.
fn window_costs(st: &WinState, cap_window: CostVector, window_ns: u64) -> (CostVector, CostVector) {
    if !st.has_avg {
        return (CostVector::ZERO, CostVector::ZERO);
    }
    let w_s = window_ns as f64 / NS_PER_S as f64;
    let per_unit = 1000.0 / st.avg_units_milli.max(1) as f64;
    let per_byte = if st.avg_bytes == 0 {
        f64::INFINITY
    } else {
        1.0 / st.avg_bytes as f64
    };
    let requests = |r: IoRate| -> f64 {
        let by_units = if r.iops == u64::MAX {
            f64::INFINITY
        } else {
            r.iops as f64 * w_s * per_unit
        };
        let by_bytes = if r.bytes_per_s == u64::MAX || per_byte.is_infinite() {
            f64::INFINITY
        } else {
            r.bytes_per_s as f64 * w_s * per_byte
        };
        by_units.min(by_bytes)
    };
    let cost = |n: f64| {
        if n.is_infinite() {
            cap_window
        } else {
            // `as` saturates; costs are capped at one window of capacity.
            st.avg_cost
                .zip(cap_window, |c, cap| ((c as f64 * n) as u64).min(cap))
        }
    };
    (
        cost(requests(st.baseline)),
        cost(requests(st.burst_ceiling)),
    )
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
        self.slots
            .get(idx as usize)
            .is_none_or(|st| !(st.burst_seen || st.last_bursting))
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

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut BurstVol) -> Verdict {
        Verdict::Run {
            phase: credit_phase(ctx, &vol.meter, &vol.credits),
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
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        } else {
            self.burst_pacer.take(now_ns, &cost, false);
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

/// The volumes of the allocation bench and tests: 100 IOPS baselines bursting on demand.
fn on_demand_100_iops() -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(100, 10_000_000),
        ceiling: IoRate::new(10_000, 1_000_000_000),
        burst: BurstMode::OnDemand,
        weight: 1,
        io_unit_bytes: 0,
    }
}

/// Drives the per-window allocation alone, for the benchmark (see `crate::bench_support`).
#[derive(Debug)]
pub(crate) struct AllocationBench {
    rules: BurstRules,
    vols: Slab<Entry<BurstVol>>,
    active: Vec<u32>,
    now_ns: u64,
    device_units_per_io: u64,
}

impl AllocationBench {
    /// `defined` volumes, the first `active` of them with usage. `oversold`: the node sold ten
    /// times its device capacity in baselines (1 device, 100 µs of device time per I/O), so
    /// round 1 is rescaled every window; otherwise the node is sized for its baselines (8
    /// workers, 8 devices, 100 GbE, 1 µs of device time per I/O), as Burst's guarantee
    /// assumes.
    pub(crate) fn new(defined: u32, active: u32, oversold: bool) -> Self {
        let capacity = NodeCapacity::new(if oversold {
            CostVector::new(1_000_000_000, 10_000_000_000, 10_000_000_000, 1_000_000_000)
        } else {
            CostVector::new(8_000_000_000, 12_500_000_000, 12_500_000_000, 8_000_000_000)
        });
        let device_units_per_io = if oversold { 100_000 } else { 1_000 };
        let mut rules = BurstRules::new(capacity, &PolicyParams::default());
        let qos = on_demand_100_iops();
        for idx in 0..defined {
            let _ = rules.new_vol(0, idx, &qos);
        }
        let mut vol = rules.new_vol(0, 0, &qos);
        for idx in 0..active {
            rules.became_backlogged(0, idx, &mut vol);
        }
        AllocationBench {
            rules,
            vols: Slab::default(),
            active: (0..active).collect(),
            now_ns: 0,
            device_units_per_io,
        }
    }

    pub(crate) fn set_cpu_level(&mut self, level: crate::cpu::CpuLevel) {
        self.rules.cpu = level;
    }

    /// Simulates one window of usage on every active volume (not part of the measurement).
    pub(crate) fn prepare(&mut self) {
        let dev = self.device_units_per_io;
        for (k, &idx) in self.active.iter().enumerate() {
            let st = self.rules.slot(idx);
            let n = 1 + (k as u64 % 7);
            st.observe(
                Charge {
                    units: 1,
                    bytes: 4096,
                },
                &CostVector::new(2_000, 0, 4096, dev),
            );
            st.consumed = CostVector::new(2_000 * n, 0, 4096 * n, dev * n);
            st.burst_seen = n / 2 > 0;
            if k % 3 == 0 {
                st.throttled = CostVector::new(2_000, 0, 4096, dev);
            }
        }
    }

    /// Runs the next window's allocation; returns the number of active volumes.
    pub(crate) fn allocate(&mut self) -> usize {
        self.now_ns += self.rules.window_ns;
        let _ = self.rules.tick(self.now_ns, &mut self.vols);
        self.rules.last_alloc.active_volumes
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

    /// A node that a few thousand 100 IOPS volumes oversell, and their on-demand QoS.
    fn test_node() -> (NodeCapacity, VolumeQos) {
        let capacity = NodeCapacity::new(CostVector::new(
            50_000_000,
            10_000_000_000,
            1_000_000_000,
            100_000_000,
        ));
        (capacity, on_demand_100_iops())
    }

    /// Every vector level the CPU has computes the same allocations, loans, donors and pool,
    /// window after window (the arithmetic is integer, so it must be bit-identical).
    #[test]
    fn allocation_is_the_same_at_every_cpu_level() {
        let (capacity, qos) = test_node();
        let run = |level: crate::cpu::CpuLevel| {
            let mut r = BurstRules::new(capacity, &PolicyParams::default());
            r.cpu = level;
            let mut dummy = r.new_vol(0, 0, &qos);
            let n = 3_000u32;
            for idx in 0..n {
                let _ = r.new_vol(0, idx, &qos);
            }
            let mut rng = XorShift64::new(11);
            let mut vols = Slab::default();
            let mut out = Vec::new();
            for w in 1..=20u64 {
                for idx in 0..n {
                    let k = rng.below(1 << 20) as u64;
                    if k.is_multiple_of(4) {
                        r.slot(idx).backlogged = false;
                        continue;
                    }
                    r.became_backlogged(0, idx, &mut dummy);
                    let st = r.slot(idx);
                    let m = 1 + k % 23;
                    st.observe(
                        Charge {
                            units: 1 + k % 3,
                            bytes: 4096 * m,
                        },
                        &CostVector::new(1_500 * m, (k % 2) * 4096 * m, 4096 * m, 90_000 * m),
                    );
                    st.consumed =
                        CostVector::new(2_000 * m, (k % 2) * 4096 * m, 4096 * m, 100_000 * m);
                    st.burst_seen = k.is_multiple_of(3);
                    if k.is_multiple_of(5) {
                        st.throttled = CostVector::new(2_000, 0, 4096, 100_000 * m);
                    }
                }
                let _ = r.tick(w * r.window_ns, &mut vols);
                let allocs: Vec<CostVector> = r.slots.iter().map(|s| s.alloc).collect();
                out.push((allocs, r.donors.clone(), r.pool_left, r.last_alloc));
            }
            out
        };
        let levels = crate::cpu::CpuLevel::available();
        let reference = run(crate::cpu::CpuLevel::Baseline);
        assert!(
            reference.iter().any(|w| !w.1.is_empty()),
            "nothing was lent"
        );
        for level in levels {
            assert_eq!(run(level), reference, "level {}", level.as_str());
        }
    }

    /// A capacity change mid-window keeps the window's allocation (clamping only what is not
    /// handed out yet, and checking the sum against the larger capacity), and the next window
    /// is allocated from the new capacity; the same capacity again changes nothing.
    #[test]
    fn capacity_change_applies_from_the_next_window() {
        let (capacity, qos) = test_node();
        let params = PolicyParams::default();
        let mut r = BurstRules::new(capacity, &params);
        let mut vol = r.new_vol(0, 0, &qos);
        let mut vols = Slab::default();
        r.became_backlogged(0, 0, &mut vol);
        let st = r.slot(0);
        st.observe(
            Charge {
                units: 1,
                bytes: 4096,
            },
            &CostVector::new(2_000, 0, 4096, 100_000),
        );
        st.consumed = CostVector::new(2_000, 0, 4096, 100_000);
        st.burst_seen = true;
        let _ = r.tick(r.window_ns, &mut vols);
        let old_cap = r.cap_window;
        let old_total = r.slots[0].alloc.saturating_add(r.pool_left);
        assert!(!r.donors.is_empty(), "the burster was lent tokens");
        // Same capacity: nothing moves.
        let before = (
            r.cap_window,
            r.pool_left,
            r.reserve_left,
            r.burst_pacer.clone(),
        );
        r.set_capacity(r.window_ns + 1, capacity);
        assert_eq!(
            (
                r.cap_window,
                r.pool_left,
                r.reserve_left,
                r.burst_pacer.clone()
            ),
            before
        );
        // Halved mid-window: the loan stays, the unlent pool and reserve shrink, the check
        // uses the larger (old) window.
        let half = NodeCapacity::new(capacity.per_second.map(|c| c / 2));
        r.set_capacity(r.window_ns + 2, half);
        assert_eq!(r.cap_window, old_cap.map(|c| c / 2));
        assert!(r.reserve_left.fits_within(&r.reserve_window));
        assert!(
            r.pool_left
                .fits_within(&r.cap_window.saturating_sub(r.reserve_window))
        );
        assert!(
            r.slots[0]
                .alloc
                .saturating_add(r.pool_left)
                .fits_within(&old_total)
        );
        assert_eq!(r.alloc_cap_window, old_cap);
        assert_eq!(r.check(&Slab::default()), Ok(()));
        // Next window: allocated from the new capacity, and checked against it alone.
        r.slot(0).consumed = CostVector::new(2_000, 0, 4096, 100_000);
        r.slot(0).burst_seen = true;
        let _ = r.tick(2 * r.window_ns, &mut vols);
        assert_eq!(r.alloc_cap_window, r.cap_window);
        assert_eq!(r.reserve_left, r.reserve_window);
        let total = r.slots[0]
            .alloc
            .saturating_add(r.pool_left)
            .saturating_add(r.reserve_left);
        assert!(total.fits_within(&r.cap_window), "{total:?}");
        assert_eq!(r.check(&Slab::default()), Ok(()));
    }

    /// The active list (a bitmap walked in slot order, with a summary bit per word) holds
    /// exactly the volumes that had usage in the last N windows, over volumes that join in
    /// random order, idle, leave and come back, across several summary words; the donors come
    /// out in slot order, each listed.
    #[test]
    fn active_list_tracks_joins_and_leaves() {
        let (capacity, qos) = test_node();
        let n = 9_000u32;
        let params = PolicyParams::default();
        let windows_n = u64::from(params.history_windows);
        let mut r = BurstRules::new(capacity, &params);
        let mut dummy = r.new_vol(0, 0, &qos);
        for idx in 0..n {
            let _ = r.new_vol(0, idx, &qos);
        }
        let mut rng = XorShift64::new(7);
        let stop: Vec<u64> = (0..n).map(|_| 1 + rng.below(12) as u64).collect();
        let restart: Vec<u64> = (0..n).map(|_| 14 + rng.below(16) as u64).collect();
        let mut last_used: Vec<Option<u64>> = vec![None; n as usize];
        let mut vols = Slab::default();
        let mut saw_leave = false;
        let mut max_listed = 0;
        for w in 1..=40u64 {
            let mut order: Vec<u32> = (0..n).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            for &idx in &order {
                let i = idx as usize;
                let k = u64::from(idx) ^ w.wrapping_mul(0x9e37);
                let used = (w < stop[i] || (w >= restart[i] && w < 32)) && k % 5 != 0;
                if !used {
                    r.slot(idx).backlogged = false;
                    continue;
                }
                last_used[i] = Some(w);
                r.became_backlogged(0, idx, &mut dummy);
                let st = r.slot(idx);
                let m = 1 + k % 7;
                st.observe(
                    Charge {
                        units: 1,
                        bytes: 4096,
                    },
                    &CostVector::new(2_000 * m, 0, 4096, 100_000),
                );
                st.consumed = CostVector::new(2_000 * m, 0, 4096 * m, 100_000 * m);
                st.burst_seen = m / 2 > 0;
            }
            let before = r.listed_count;
            let _ = r.tick(w * r.window_ns, &mut vols);
            saw_leave |= r.listed_count < before;
            max_listed = max_listed.max(r.listed_count);
            let expected: Vec<u32> = (0..n)
                .filter(|&idx| last_used[idx as usize].is_some_and(|u| w - u < windows_n))
                .collect();
            let listed: Vec<u32> = (0..n).filter(|&idx| bit(&r.listed, idx)).collect();
            assert_eq!(listed, expected, "window {w}");
            for (idx, st) in r.slots.iter().enumerate() {
                assert_eq!(
                    st.in_list,
                    bit(&r.listed, idx as u32),
                    "window {w} slot {idx}"
                );
            }
            for (word_idx, word) in r.listed.iter().enumerate() {
                assert_eq!(*word != 0, bit(&r.listed_words, word_idx as u32));
            }
            assert_eq!(r.listed_count, expected.len());
            assert_eq!(r.last_alloc.active_volumes, expected.len());
            assert!(r.donors.windows(2).all(|d| d[0].idx < d[1].idx));
            assert!(r.donors.iter().all(|d| bit(&r.listed, d.idx)));
        }
        assert!(saw_leave, "no volume left the list");
        assert!(max_listed > 4096, "the list stayed within one summary word");
        assert_eq!(r.listed_count, 0, "every volume idles out at the end");
    }
}
