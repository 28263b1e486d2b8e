//! Exact token buckets: the one primitive behind rate limits, baseline meters and credits.
//!
//! Published burst timelines (gp2: 2,000 s then 300 IOPS; QEMU: 12.5 s then 1,000) are exact
//! rational numbers. A bucket that refills `rate` units/s and stores its level in whole units
//! or in float drifts away from them (1e9 / 3,000 ns is not an integer). So the level is kept
//! in *nano-units* (unit × 10⁹): over `dt` ns the bucket gains exactly `rate × dt` nano-units,
//! and the time to reach a level is a single ceiling division. Dispatch times are therefore the
//! exact `ceil(k × 10⁹ / rate)` for every k, with no accumulated rounding.
//!
//! Two admission styles share the type:
//! - *credit* use (`credit_ready_at`/`take_credit`): a request may run on any positive balance
//!   and is charged in full, so the level dips below zero by less than one request at most
//!   (QEMU's rule, and the fluid model behind the published burst timelines);
//! - *limiter* use (`ready_at`/`take`): a request needs one unit in the bucket (or a full
//!   bucket if it is shallower), then its full cost is charged, so a large request leaves a
//!   debt. Over any interval `T` a limiter therefore admits at most
//!   `capacity + rate × T + one request`. Depth beyond one unit lets a volume that was held
//!   back (by the node pacer, by its neighbours' turns) catch up instead of losing that rate.
//!
//! A limiter is usually one unit deep and a request waits until the bucket holds exactly that
//! unit. Waits are whole nanoseconds (rounded up), so the bucket is then a fraction of a
//! nanosecond's refill *over* its capacity; clamping that away would lose a little rate on
//! every request (3,000/s would become 2,999.99…/s). Limiter buckets therefore keep up to
//! `rate − 1` nano-units (less than one nanosecond of refill) above their capacity.

use crate::vocab::NS_PER_S;

const NANO: i128 = NS_PER_S as i128;

/// A token bucket with an exact integer level.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    /// Refill rate in units per second; `u64::MAX` means unlimited (always full, never charged).
    rate_per_s: u64,
    /// Maximum level in whole units (in nano-units: `× 10⁹`, see `capacity_nano`). Stored in
    /// units, not as an `i128` of nano-units, so a bucket is 48 bytes instead of 64.
    capacity_units: u64,
    /// Current level in nano-units at `last_ns` (negative = debt, limiter use only).
    level_nano: i128,
    /// Limiter buckets keep a sub-nanosecond rounding allowance above capacity.
    limiter: bool,
    /// Time of the last update.
    last_ns: u64,
}

impl TokenBucket {
    /// A credit bucket of `capacity_units` refilled at `rate_per_s`, full or empty at `now_ns`.
    pub fn new(now_ns: u64, rate_per_s: u64, capacity_units: u64, start_full: bool) -> Self {
        let capacity_nano = i128::from(capacity_units) * NANO;
        TokenBucket {
            rate_per_s,
            capacity_units,
            level_nano: if start_full { capacity_nano } else { 0 },
            limiter: false,
            last_ns: now_ns,
        }
    }

    /// A limiter bucket holding `initial_units` (at most its capacity; none at a zero rate)
    /// at `now_ns`, keeping sub-nanosecond rounding exact.
    pub fn new_limiter(
        now_ns: u64,
        rate_per_s: u64,
        capacity_units: u64,
        initial_units: u64,
    ) -> Self {
        let mut b = TokenBucket::new(now_ns, rate_per_s, capacity_units, false);
        b.limiter = true;
        if rate_per_s > 0 {
            b.level_nano = (i128::from(initial_units) * NANO).min(b.capacity_nano());
        }
        b
    }

    /// Rounding allowance above capacity: less than one nanosecond of refill, limiters only.
    fn slack_nano(&self) -> i128 {
        if self.limiter {
            limiter_slack(self.rate_per_s)
        } else {
            0
        }
    }

    /// Whether the bucket never limits.
    pub fn is_unlimited(&self) -> bool {
        self.rate_per_s == u64::MAX
    }

    /// Refill rate, units per second.
    pub fn rate_per_s(&self) -> u64 {
        self.rate_per_s
    }

    /// Capacity in whole units.
    pub fn capacity_units(&self) -> u64 {
        self.capacity_units
    }

    /// Level in nano-units at `now_ns` (without changing the bucket).
    pub fn level_nano_at(&self, now_ns: u64) -> i128 {
        let top = self.capacity_nano() + self.slack_nano();
        if now_ns <= self.last_ns || self.level_nano >= top {
            return self.level_nano;
        }
        let dt = u128::from(now_ns - self.last_ns);
        let gain = u128::from(self.rate_per_s).saturating_mul(dt);
        let room = (top - self.level_nano) as u128;
        if gain >= room {
            top
        } else {
            self.level_nano + gain as i128
        }
    }

    /// Whole units available at `now_ns` (0 when in debt).
    pub fn whole_units_at(&self, now_ns: u64) -> u64 {
        let l = self.level_nano_at(now_ns);
        if l <= 0 {
            0
        } else {
            u64::try_from(l / NANO).unwrap_or(u64::MAX)
        }
    }

    /// Brings the level up to date at `now_ns` (time never goes backwards).
    pub fn advance(&mut self, now_ns: u64) {
        if now_ns > self.last_ns {
            self.level_nano = self.level_nano_at(now_ns);
            self.last_ns = now_ns;
        }
    }

    /// Limiter use: earliest time `>= now_ns` at which a request of `units` may pass: when
    /// the bucket holds one unit (or is full, if shallower). The request is then charged in
    /// full, so a large request leaves a debt. `u64::MAX` if it never will (zero rate).
    pub fn ready_at(&self, now_ns: u64, units: u64) -> u64 {
        if self.is_unlimited() || units == 0 {
            return now_ns;
        }
        self.time_to_reach(now_ns, NANO.min(self.capacity_nano()))
    }

    /// Limiter use: earliest time `>= now_ns` at which the level is at least `−allowance`
    /// units (a request may run inside that much debt).
    pub fn ready_with_allowance_at(&self, now_ns: u64, allowance_units: u64) -> u64 {
        if self.is_unlimited() {
            return now_ns;
        }
        self.time_to_reach(now_ns, -(i128::from(allowance_units) * NANO))
    }

    /// Credit use: earliest time `>= now_ns` at which the balance is positive. A request may
    /// run on any positive balance and is charged in full, so the balance can dip below zero by
    /// less than that one request. This is QEMU's rule (a request waits only while the level
    /// *exceeds* the bucket) and the fluid model behind the published timelines: a full gp2
    /// bucket at 3,000 IOPS serves exactly 6,000,000 requests in the first 2,000 s.
    /// `u64::MAX` if never (zero refill).
    pub fn credit_ready_at(&self, now_ns: u64) -> u64 {
        if self.is_unlimited() {
            return now_ns;
        }
        self.time_to_reach(now_ns, 1)
    }

    fn time_to_reach(&self, now_ns: u64, need_nano: i128) -> u64 {
        let level = self.level_nano_at(now_ns);
        if level >= need_nano {
            return now_ns;
        }
        if self.rate_per_s == 0 {
            return u64::MAX;
        }
        let deficit = (need_nano - level) as u128;
        // A deficit that fits 64 bits (every one but absurd rates or debts) divides in 64 bits:
        // the same exact ceiling, without the 128-bit division routine on the hot path.
        let wait = match u64::try_from(deficit) {
            Ok(d) => Some(d.div_ceil(self.rate_per_s)),
            Err(_) => u64::try_from(deficit.div_ceil(u128::from(self.rate_per_s))).ok(),
        };
        wait.and_then(|w| now_ns.checked_add(w)).unwrap_or(u64::MAX)
    }

    /// Limiter use: charges `units` at `now_ns` (may leave a debt).
    pub fn take(&mut self, now_ns: u64, units: u64) {
        if self.is_unlimited() {
            return;
        }
        self.advance(now_ns);
        self.level_nano = self.level_nano.saturating_sub(i128::from(units) * NANO);
    }

    /// Credit use: charges `units` in full (see [`TokenBucket::credit_ready_at`]).
    pub fn take_credit(&mut self, now_ns: u64, units: u64) {
        if self.is_unlimited() {
            return;
        }
        self.advance(now_ns);
        self.level_nano = self.level_nano.saturating_sub(i128::from(units) * NANO);
    }

    /// Caps the level at `units` at `now_ns` (drops saved-up service).
    pub fn cap_level(&mut self, now_ns: u64, units: u64) {
        self.advance(now_ns);
        self.level_nano = self.level_nano.min(i128::from(units) * NANO);
    }

    /// Sets the level to `units` at `now_ns`, clamped to the capacity, whatever it was (a
    /// debt included). For restoring a persisted credit balance after a restart: the caller
    /// decides the level, so this may raise it, but never above the capacity.
    pub fn set_level_units(&mut self, now_ns: u64, units: u64) {
        self.advance(now_ns);
        self.level_nano = (i128::from(units) * NANO).min(self.capacity_nano());
    }

    /// Caps a limiter's debt at `units` (forgives anything beyond).
    pub fn limit_debt(&mut self, units: u64) {
        self.level_nano = self.level_nano.max(-(i128::from(units) * NANO));
    }

    /// Gives back `units` (e.g. tokens moved between volumes), capped at capacity.
    pub fn give(&mut self, now_ns: u64, units: u64) {
        if self.is_unlimited() {
            return;
        }
        self.advance(now_ns);
        self.level_nano = self
            .level_nano
            .saturating_add(i128::from(units) * NANO)
            .min(self.capacity_nano() + self.slack_nano());
    }

    /// Changes rate and capacity live. The level is kept (clamped to the new capacity), never
    /// refilled: a QoS change must not hand out a fresh burst.
    ///
    /// A limiter that was unlimited was conceptually always full, so it starts full; one that
    /// had a zero rate starts from its (empty) level.
    pub fn reconfigure(&mut self, now_ns: u64, rate_per_s: u64, capacity_units: u64) {
        self.advance(now_ns);
        let was_unlimited = self.is_unlimited();
        self.rate_per_s = rate_per_s;
        self.capacity_units = capacity_units;
        if self.limiter && was_unlimited && rate_per_s > 0 {
            self.level_nano = self.capacity_nano();
        }
        self.level_nano = self
            .level_nano
            .min(self.capacity_nano() + self.slack_nano());
    }

    /// True when the stored level lies within `[floor_nano, capacity]` (plus the limiter's
    /// sub-nanosecond rounding allowance).
    pub fn level_within(&self, floor_nano: i128) -> bool {
        self.level_nano >= floor_nano && self.level_nano <= self.capacity_nano() + self.slack_nano()
    }

    /// Raw level in nano-units as stored (for invariant checks and snapshots).
    pub fn level_nano(&self) -> i128 {
        self.level_nano
    }

    /// Capacity in nano-units.
    pub fn capacity_nano(&self) -> i128 {
        i128::from(self.capacity_units) * NANO
    }
}

fn limiter_slack(rate_per_s: u64) -> i128 {
    if rate_per_s == u64::MAX {
        0
    } else {
        i128::from(rate_per_s.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_paces_exactly_at_non_integer_intervals() {
        // 3,000/s: the k-th request may pass at ceil(k * 1e9 / 3000) ns, exactly.
        let mut b = TokenBucket::new_limiter(0, 3_000, 1, 1);
        let mut now = 0;
        for k in 0..9_001u64 {
            now = b.ready_at(now, 1);
            assert_eq!(now, (k * NS_PER_S).div_ceil(3_000), "request {k}");
            b.take(now, 1);
        }
        // 3,000 requests in every whole second.
        assert_eq!(now, 3 * NS_PER_S);
    }

    #[test]
    fn large_request_passes_from_full_bucket_and_leaves_debt() {
        let mut b = TokenBucket::new_limiter(0, 10, 1, 1);
        assert_eq!(b.ready_at(0, 4), 0);
        b.take(0, 4);
        // Debt of 3 units: the next request waits 4 units' worth = 400 ms.
        assert_eq!(b.ready_at(0, 1), 400_000_000);
        // A deeper limiter saves up while its volume is held back, up to its depth.
        let mut deep = TokenBucket::new_limiter(0, 10, 5, 1);
        deep.take(0, 1);
        assert_eq!(deep.whole_units_at(10 * NS_PER_S), 5);
        assert_eq!(deep.ready_at(10 * NS_PER_S, 3), 10 * NS_PER_S);
        // A zero-rate limiter starts empty: it never admits anything.
        assert_eq!(
            TokenBucket::new_limiter(0, 0, 1, 1).ready_at(0, 1),
            u64::MAX
        );
    }

    #[test]
    fn credits_run_on_a_positive_balance_and_cap_at_capacity() {
        let mut b = TokenBucket::new(0, 100, 1_000, false);
        // Empty: positive after one nanosecond of refill.
        assert_eq!(b.credit_ready_at(0), 1);
        b.advance(100 * NS_PER_S);
        assert_eq!(b.whole_units_at(100 * NS_PER_S), 1_000);
        b.take_credit(100 * NS_PER_S, 400);
        assert_eq!(b.whole_units_at(100 * NS_PER_S), 600);
        b.take_credit(100 * NS_PER_S, 700);
        // 100 units of debt: reported as 0, refilled in exactly one second.
        assert_eq!(b.whole_units_at(100 * NS_PER_S), 0);
        assert!(b.level_within(-100 * NANO));
        assert!(!b.level_within(-99 * NANO));
        assert_eq!(b.credit_ready_at(100 * NS_PER_S), 101 * NS_PER_S + 1);
        let zero = TokenBucket::new(0, 0, 10, false);
        assert_eq!(zero.credit_ready_at(5), u64::MAX);
    }

    #[test]
    fn reconfigure_keeps_level_and_never_refills() {
        let mut b = TokenBucket::new(0, 100, 1_000, true);
        b.take_credit(0, 900);
        b.reconfigure(0, 200, 5_000);
        assert_eq!(b.whole_units_at(0), 100);
        b.reconfigure(0, 200, 50);
        assert_eq!(b.whole_units_at(0), 50);
        assert_eq!(b.whole_units_at(NS_PER_S), 50);
    }

    #[test]
    fn set_level_clamps_to_capacity_and_refills_from_there() {
        let mut b = TokenBucket::new(0, 100, 1_000, true);
        b.set_level_units(0, 250);
        assert_eq!(b.whole_units_at(0), 250);
        // Refills from the new level at its rate, up to the capacity.
        assert_eq!(b.whole_units_at(NS_PER_S), 350);
        assert_eq!(b.whole_units_at(100 * NS_PER_S), 1_000);
        b.set_level_units(NS_PER_S, u64::MAX);
        assert_eq!(b.whole_units_at(NS_PER_S), 1_000);
        assert!(b.level_within(0));
        // A debt is replaced, not added to.
        b.take_credit(NS_PER_S, 1_500);
        b.set_level_units(NS_PER_S, 0);
        assert_eq!(b.level_nano(), 0);
        assert_eq!(b.credit_ready_at(NS_PER_S), NS_PER_S + 1);
    }

    #[test]
    fn unlimited_bucket_never_waits() {
        let mut b = TokenBucket::new_limiter(0, u64::MAX, 1, 0);
        b.take(0, 1_000_000);
        assert_eq!(b.ready_at(0, 1_000_000), 0);
        assert_eq!(b.credit_ready_at(5), 5);
    }

    #[test]
    fn zero_rate_waits_forever_once_empty() {
        let mut b = TokenBucket::new(0, 0, 2, true);
        b.take(0, 2);
        assert_eq!(b.ready_at(10, 1), u64::MAX);
    }
}
