//! Burst's window allocation kernel: Algorithm 1 of BurstCBS (docs/background.md §1.4).
//!
//! Why a module of its own: this is what runs once per window over every active volume
//! (pass 1 closes the window, pushes the usage history and predicts: round 1; pass 2 lends what
//! is left: round 2), plus the fast recovery that moves tokens back to a volume whose
//! prediction was low. It is the part of Burst tuned for cache lines and vector levels
//! (`crate::cpu`) and benchmarked alone (`burst_window_allocation`), and it reads apart from
//! the per-request rules in the parent module (classify, charge, class gates), which call it
//! only through [`BurstRules::allocate`] (from `tick`), [`BurstRules::recover`] (from
//! `charge`) and [`BurstRules::cancel_loan`].
//!
//! It works on state the parent defines (`BurstRules`' slots, history planes, active list,
//! lenders and donors; each volume's `WinState`, whose `repr(C)` layout serves both the I/O
//! path and this kernel): as a child module it sees their private fields.

use super::{BurstRules, WinState};
use crate::cost::CostVector;
use crate::vocab::{IoRate, NS_PER_S, NodeCapacity};

/// Fixed-point shift for shares and ratios.
const FP: u32 = 32;

/// A volume kept in the active list by round 1 of the allocation, gathered densely so that
/// the rescale and round 2 (lending) read one array and write each volume's state once.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lender {
    idx: u32,
    /// Lending weight (0: may not burst).
    weight: u64,
    /// Its round-1 allocation (after any scaling).
    alloc: CostVector,
}

/// A volume lent tokens this window, and how many (less what recovery has taken back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Donor {
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
pub(super) struct Derived {
    /// One window of capacity (`u64::MAX` where unlimited).
    pub(super) cap_window: CostVector,
    /// The part of it held back for fast recovery.
    pub(super) reserve_window: CostVector,
    /// Rate of the burst pacer: capacity less the reserve.
    pub(super) burst_rate: CostVector,
    /// `2^FP / cap_window` per dimension (0 where the dimension is unlimited).
    pub(super) inv_cap_window: [u64; 4],
}

impl Derived {
    pub(super) fn of(capacity: NodeCapacity, window_ns: u64, reserve_permille: u64) -> Self {
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

impl BurstRules {
    /// Dominant share of a cost vector relative to one window of capacity, fixed point `2^FP`.
    fn dominant_share(&self, v: &CostVector) -> u64 {
        dominant_share(&self.inv_cap_window, v)
    }

    /// Ends the finished window and computes the next window's allocations (Algorithm 1),
    /// compiled for the CPU's vector level (`crate::cpu`: same results at every level).
    pub(super) fn allocate(&mut self, gap_windows: u64) {
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
    pub(super) fn recover(&mut self, idx: u32, mut need: CostVector) {
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

    /// Cancels what volume `idx` was lent this window (it was removed, or a new volume took
    /// its slot): recovery must not take tokens from it.
    pub(super) fn cancel_loan(&mut self, idx: u32) {
        // Nothing lent any more (rare: volumes are added and removed, not per I/O).
        if let Some(d) = self.donors.iter_mut().find(|d| d.idx == idx) {
            d.lent = CostVector::ZERO;
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

#[cfg(test)]
mod tests {
    use super::super::bench::on_demand_100_iops;
    use super::super::bit;
    use super::*;
    use crate::engine::Rules;
    use crate::limiter::Charge;
    use crate::policy::PolicyParams;
    use crate::rng::XorShift64;
    use crate::sched::Slab;
    use crate::vocab::VolumeQos;

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
