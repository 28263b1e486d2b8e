//! Per-volume rate limiters and credit buckets built from [`TokenBucket`]s.
//!
//! A volume's limits come in two dimensions (I/O units and payload bytes), and a request must
//! satisfy both; the longest wait wins, as in QEMU's throttle groups. Limiters are one unit
//! deep (plus the debt rule of [`TokenBucket`]), so they pace instead of allowing hidden bursts:
//! the only burst a volume gets is the one its credit bucket pays for.

use crate::bucket::TokenBucket;
use crate::cost::CostVector;
use crate::vocab::{CreditBucketSpec, CreditSpec, IoRate, IoRequest, OpKind, VolumeQos, io_units};

/// How much of a volume's limits one request consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    /// I/O units (AWS-style: `ceil(len / io_unit_bytes)` for reads and writes, 1 otherwise).
    pub units: u64,
    /// Payload bytes (reads and writes only).
    pub bytes: u64,
}

impl Charge {
    /// The charge of `req` under `qos`.
    pub fn of(qos: &VolumeQos, req: &IoRequest) -> Charge {
        Charge::for_unit(qos.io_unit_bytes, req)
    }

    /// The charge of `req` for a volume whose I/O unit is `io_unit_bytes`.
    pub(crate) fn for_unit(io_unit_bytes: u32, req: &IoRequest) -> Charge {
        let units = match req.op {
            OpKind::Read | OpKind::Write => io_units(io_unit_bytes, req.len_bytes),
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => 1,
        };
        Charge {
            units,
            bytes: req.payload_bytes(),
        }
    }
}

/// Depth in units of a limiter at `rate_per_s` that may save up `depth_ns` of service (at least one).
pub fn depth_units(rate_per_s: u64, depth_ns: u64) -> u64 {
    if rate_per_s == u64::MAX {
        1
    } else {
        crate::cost::mul_div_ceil(rate_per_s, depth_ns, crate::vocab::NS_PER_S).max(1)
    }
}

/// A two-dimensional (I/O units, bytes) pacing limiter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimiter {
    iops: TokenBucket,
    bytes: TokenBucket,
    depth_ns: u64,
}

impl RateLimiter {
    /// A limiter at `rate` that can save up `depth_ns` of service (at least one unit) for a
    /// volume that was held back, starting with one unit (one request may pass at once).
    pub fn new(now_ns: u64, rate: IoRate, depth_ns: u64) -> Self {
        RateLimiter {
            iops: TokenBucket::new_limiter(now_ns, rate.iops, depth_units(rate.iops, depth_ns), 1),
            bytes: TokenBucket::new_limiter(
                now_ns,
                rate.bytes_per_s,
                depth_units(rate.bytes_per_s, depth_ns),
                1,
            ),
            depth_ns,
        }
    }

    /// Earliest time `>= now_ns` at which `charge` may pass.
    pub fn ready_at(&self, now_ns: u64, charge: Charge) -> u64 {
        let t_iops = self.iops.ready_at(now_ns, charge.units);
        let t_bytes = if charge.bytes == 0 {
            now_ns
        } else {
            self.bytes.ready_at(now_ns, charge.bytes)
        };
        t_iops.max(t_bytes)
    }

    /// Charges a request.
    pub fn take(&mut self, now_ns: u64, charge: Charge) {
        self.iops.take(now_ns, charge.units);
        if charge.bytes > 0 {
            self.bytes.take(now_ns, charge.bytes);
        }
    }

    /// Forgives any debt at `now_ns`: the level is raised to zero if below, never refilled
    /// above it.
    pub fn forgive_debt(&mut self, now_ns: u64) {
        for b in [&mut self.iops, &mut self.bytes] {
            b.advance(now_ns);
            b.limit_debt(0);
        }
    }

    /// Changes the rate live, keeping the current level (clamped to the new depth).
    pub fn reconfigure(&mut self, now_ns: u64, rate: IoRate) {
        let d = self.depth_ns;
        self.iops
            .reconfigure(now_ns, rate.iops, depth_units(rate.iops, d));
        self.bytes
            .reconfigure(now_ns, rate.bytes_per_s, depth_units(rate.bytes_per_s, d));
    }
}

/// The credit buckets of a volume in credit-burst mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeCredits {
    /// Credits in I/O units.
    pub iops: Option<TokenBucket>,
    /// Credits in bytes.
    pub bytes: Option<TokenBucket>,
    /// Largest single charge seen per bucket (I/O units, bytes): the most a balance may dip
    /// below zero.
    pub max_charge: (u64, u64),
}

fn bucket_from(now_ns: u64, spec: &CreditBucketSpec) -> TokenBucket {
    TokenBucket::new(now_ns, spec.refill_per_s, spec.capacity, spec.start_full)
}

impl VolumeCredits {
    /// Buckets for a QoS (empty when the volume is not in credit mode).
    pub fn new(now_ns: u64, qos: &VolumeQos) -> Self {
        match &qos.burst {
            crate::vocab::BurstMode::Credits(spec) => VolumeCredits {
                iops: spec.iops.as_ref().map(|s| bucket_from(now_ns, s)),
                bytes: spec.bytes.as_ref().map(|s| bucket_from(now_ns, s)),
                max_charge: (0, 0),
            },
            _ => VolumeCredits::default(),
        }
    }

    /// Whether the volume has any credit bucket.
    pub fn is_active(&self) -> bool {
        self.iops.is_some() || self.bytes.is_some()
    }

    /// Earliest time `>= now_ns` at which every bucket `charge` draws on has a positive
    /// balance (now if no bucket).
    pub fn ready_at(&self, now_ns: u64, charge: Charge) -> u64 {
        let a = self
            .iops
            .as_ref()
            .map_or(now_ns, |b| b.credit_ready_at(now_ns));
        let b = match &self.bytes {
            Some(b) if charge.bytes > 0 => b.credit_ready_at(now_ns),
            _ => now_ns,
        };
        a.max(b)
    }

    /// Spends credits for a request (in full; see [`TokenBucket::credit_ready_at`]).
    pub fn take(&mut self, now_ns: u64, charge: Charge) {
        if let Some(b) = &mut self.iops {
            b.take_credit(now_ns, charge.units);
            self.max_charge.0 = self.max_charge.0.max(charge.units);
        }
        if let Some(b) = &mut self.bytes
            && charge.bytes > 0
        {
            b.take_credit(now_ns, charge.bytes);
            self.max_charge.1 = self.max_charge.1.max(charge.bytes);
        }
    }

    /// Applies a new QoS live: existing buckets keep their balance (clamped to a smaller
    /// capacity); a bucket that did not exist before starts *empty* (a QoS change is not a
    /// fresh burst); a bucket no longer configured is dropped.
    pub fn reconfigure(&mut self, now_ns: u64, qos: &VolumeQos) {
        let spec = match &qos.burst {
            crate::vocab::BurstMode::Credits(spec) => *spec,
            _ => CreditSpec {
                iops: None,
                bytes: None,
                pool: None,
            },
        };
        reconfigure_one(&mut self.iops, now_ns, spec.iops.as_ref());
        reconfigure_one(&mut self.bytes, now_ns, spec.bytes.as_ref());
    }

    /// Restores persisted balances at `now_ns` (after a restart): each bucket the volume has
    /// is set to `min(value, capacity)`, whether it started full or empty; `None` leaves that
    /// bucket as it is, and a value for a bucket the volume does not have is ignored. Returns
    /// whether any bucket was set.
    pub fn restore(&mut self, now_ns: u64, iops: Option<u64>, bytes: Option<u64>) -> bool {
        let mut changed = false;
        for (slot, value) in [(&mut self.iops, iops), (&mut self.bytes, bytes)] {
            if let (Some(b), Some(v)) = (slot.as_mut(), value) {
                b.set_level_units(now_ns, v);
                changed = true;
            }
        }
        changed
    }

    /// Whole credits in each bucket at `now_ns`.
    pub fn balances_at(&self, now_ns: u64) -> (Option<u64>, Option<u64>) {
        (
            self.iops.as_ref().map(|b| b.whole_units_at(now_ns)),
            self.bytes.as_ref().map(|b| b.whole_units_at(now_ns)),
        )
    }

    /// True when every bucket's level lies within `[−(largest single charge), capacity]`: the
    /// reported balance (whole credits, never negative) is then within `[0, capacity]`, and a
    /// balance only dips below zero by the one request admitted on a positive balance.
    pub fn within_range(&self) -> bool {
        let floor = |units: u64| -(i128::from(units) * i128::from(crate::vocab::NS_PER_S));
        self.iops
            .as_ref()
            .is_none_or(|b| b.level_within(floor(self.max_charge.0)))
            && self
                .bytes
                .as_ref()
                .is_none_or(|b| b.level_within(floor(self.max_charge.1)))
    }
}

fn reconfigure_one(slot: &mut Option<TokenBucket>, now_ns: u64, spec: Option<&CreditBucketSpec>) {
    match (slot.as_mut(), spec) {
        (Some(b), Some(s)) => b.reconfigure(now_ns, s.refill_per_s, s.capacity),
        (None, Some(s)) => {
            *slot = Some(TokenBucket::new(now_ns, s.refill_per_s, s.capacity, false));
        }
        (_, None) => *slot = None,
    }
}

/// The node-wide pacer: one limiter per cost dimension at the node's capacity, one request deep.
///
/// It saves up at most the cost of the largest request it has admitted (or `depth_ns` of
/// capacity, if more): a caller that asks a little late, because its worker was busy with the
/// previous request when the pacer refilled, loses nothing, as long as it is late by less than
/// one request. A zero-deep pacer lost every such delay for good: a node whose worker threads
/// are half busy with CPU work reached 85 % of its NIC instead of 98 %. Over any interval `T`
/// it admits at most `capacity × T` plus what it saved up plus the request admitted last.
///
/// Requests are not preemptible, so one large burst request (a 1 MiB read on a 50 MB/s link
/// holds egress for 21 ms) would delay every baseline request that becomes ready while it runs,
/// and a volume whose ceiling equals its baseline could never catch up: its guarantee would
/// silently shrink. And a pacer that spaced baseline requests exactly at the capacity made two
/// that arrive together wait for each other: nothing at a node's full capacity, but a whole
/// request's time at a small one (a node given 750 IOPS of a shared pool over two workers, for
/// 600 IOPS of tenants within their baselines, held one read in ten back by more than 3 ms
/// that way, where the pool answers in 1.2 ms; docs/results.md, "A pool with a capacity of
/// its own"). So a *baseline* request may run inside a debt of one request, the largest
/// admitted (the depth's own unit): it is interleaved with the request before it, burst or
/// not, as a NIC interleaves streams, and still pays for itself, so burst traffic waits
/// longer. The cost: over any interval the pacer admits at most `capacity × T` plus what it
/// saved up plus one (largest) request and one baseline request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pacer {
    dims: [TokenBucket; 4],
    /// How much unused capacity the pacer may save up, ns, at least one request (below).
    depth_ns: u64,
    /// The largest cost admitted so far, per dimension: the smallest depth of each bucket, and
    /// the debt a baseline request may run inside.
    largest: [u64; 4],
}

impl Pacer {
    /// A pacer at `per_second` (a component of `u64::MAX` never limits), saving up one request (see above).
    pub fn new(now_ns: u64, per_second: CostVector) -> Self {
        Self::with_depth(now_ns, per_second, 0)
    }

    /// A pacer that may save up `depth_ns` of unused capacity (Burst's burst pacer, which
    /// measures a share over time rather than spacing each request).
    pub fn with_depth(now_ns: u64, per_second: CostVector, depth_ns: u64) -> Self {
        let d = per_second.dims();
        Pacer {
            dims: d
                .map(|rate| TokenBucket::new_limiter(now_ns, rate, pacer_depth(rate, depth_ns), 0)),
            depth_ns,
            largest: [0; 4],
        }
    }

    /// Changes the rate live at `now_ns` (the node moved capacity between its workers): each
    /// dimension keeps its current level (a debt included), clamped to the new depth; nothing
    /// is refilled by the change. The same rate again changes nothing.
    ///
    /// A dimension that was unlimited was conceptually always full, so it starts full (at its
    /// new depth: nothing at depth 0), as [`TokenBucket::reconfigure`] has it.
    pub fn set_rate(&mut self, now_ns: u64, per_second: CostVector) {
        let depth_ns = self.depth_ns;
        for ((bucket, rate), largest) in self
            .dims
            .iter_mut()
            .zip(per_second.dims())
            .zip(self.largest)
        {
            if bucket.rate_per_s() != rate {
                bucket.reconfigure(now_ns, rate, pacer_depth(rate, depth_ns).max(largest));
            }
        }
    }

    /// Per dimension the request needs (index in [`CostVector::dims`] order), the earliest time
    /// `>= now_ns` it may pass there: when the dimension is not in debt (a deep bucket does
    /// not wait for a unit above zero), a `baseline` request when the debt is within the
    /// largest request admitted.
    fn dim_ready_at(
        &self,
        now_ns: u64,
        cost: &CostVector,
        baseline: bool,
    ) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.dims
            .iter()
            .zip(cost.dims())
            .zip(self.largest)
            .enumerate()
            .filter(|(_, ((_, units), _))| *units > 0)
            .map(move |(i, ((bucket, _), largest))| {
                let allowance = if baseline { largest } else { 0 };
                (i, bucket.ready_with_allowance_at(now_ns, allowance))
            })
    }

    /// Earliest time `>= now_ns` at which a request of `cost` may pass; `baseline` requests may
    /// run inside the debt of one (the largest) request.
    pub fn ready_at(&self, now_ns: u64, cost: &CostVector, baseline: bool) -> u64 {
        self.dim_ready_at(now_ns, cost, baseline)
            .fold(now_ns, |t, (_, ready)| t.max(ready))
    }

    /// The dimensions (a bit each, [`CostVector::dims_mask`] order) that keep a request of
    /// `cost` from passing at `now_ns`: those it needs whose bucket is not ready. A request
    /// that needs none of them is not held back by them.
    pub fn blocking_dims(&self, now_ns: u64, cost: &CostVector, baseline: bool) -> u8 {
        self.dim_ready_at(now_ns, cost, baseline)
            .filter(|&(_, ready)| ready > now_ns)
            .fold(0u8, |mask, (i, _)| mask | 1 << i)
    }

    /// Whether nothing is in debt (every dimension could admit any request now).
    pub fn idle_at(&self, now_ns: u64) -> bool {
        self.dims.iter().all(|b| b.ready_at(now_ns, 1) <= now_ns)
    }

    /// Charges a request.
    pub fn take(&mut self, now_ns: u64, cost: &CostVector) {
        for ((bucket, units), largest) in self
            .dims
            .iter_mut()
            .zip(cost.dims())
            .zip(self.largest.iter_mut())
        {
            if units > 0 {
                if units > *largest {
                    *largest = units;
                    if units > bucket.capacity_units() && !bucket.is_unlimited() {
                        // Deeper by the new largest request (the level is kept: no refill).
                        bucket.reconfigure(now_ns, bucket.rate_per_s(), units);
                    }
                }
                bucket.take(now_ns, units);
            }
        }
    }
}

/// Depth in units of one pacer dimension at `rate` saving up `depth_ns` (0 for no depth).
fn pacer_depth(rate: u64, depth_ns: u64) -> u64 {
    if depth_ns == 0 {
        0
    } else {
        depth_units(rate, depth_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{BurstMode, NS_PER_S};

    fn req(op: OpKind, len_bytes: u32) -> IoRequest {
        IoRequest {
            id: 0,
            volume: 0,
            op,
            offset_bytes: 0,
            len_bytes,
            cost: CostVector::ZERO,
            arrival_ns: 0,
        }
    }

    #[test]
    fn charge_counts_aws_units_and_payload() {
        let qos = VolumeQos {
            io_unit_bytes: 256 * 1024,
            ..VolumeQos::default()
        };
        assert_eq!(
            Charge::of(&qos, &req(OpKind::Read, 1 << 20)),
            Charge {
                units: 4,
                bytes: 1 << 20
            }
        );
        assert_eq!(
            Charge::of(&qos, &req(OpKind::Trim, u32::MAX)),
            Charge { units: 1, bytes: 0 }
        );
    }

    #[test]
    fn pacer_rate_change_keeps_the_level_and_grants_nothing() {
        let cap = CostVector::new(1_000, u64::MAX, u64::MAX, u64::MAX);
        let cost = CostVector::new(100, 0, 0, 0);
        // 100 units of debt at 1,000/s is 100 ms; after 50 ms at half the rate the remaining
        // 50 units take 100 ms.
        let mut p = Pacer::new(0, cap);
        p.take(0, &cost);
        let same = p.clone();
        p.set_rate(50_000_000, cap);
        assert_eq!(p, same, "the same rate changes nothing");
        p.set_rate(
            50_000_000,
            CostVector::new(500, u64::MAX, u64::MAX, u64::MAX),
        );
        assert_eq!(p.ready_at(50_000_000, &cost, false), 150_000_000);
        // With depth (10 ms): a full pacer halved keeps only the new depth; doubled, it keeps
        // its level (no fresh tokens) and refills at the new rate.
        let mut p = Pacer::with_depth(0, cap, 10_000_000);
        assert_eq!(
            p.ready_at(20_000_000, &CostVector::new(10, 0, 0, 0), false),
            20_000_000
        );
        p.set_rate(
            20_000_000,
            CostVector::new(500, u64::MAX, u64::MAX, u64::MAX),
        );
        p.take(20_000_000, &CostVector::new(5, 0, 0, 0));
        assert!(!p.idle_at(20_000_000));
        let mut q = Pacer::with_depth(0, cap, 10_000_000);
        q.take(0, &CostVector::new(10, 0, 0, 0));
        q.set_rate(0, CostVector::new(2_000, u64::MAX, u64::MAX, u64::MAX));
        // 10 units in debt: 10 units at 2,000/s, 5 ms.
        assert_eq!(
            q.ready_at(0, &CostVector::new(1, 0, 0, 0), false),
            5_000_000
        );
    }

    #[test]
    fn baseline_requests_may_run_inside_one_requests_debt_and_no_further() {
        // 100 units a request at 1,000/s: 100 ms each. Two baseline requests that arrive
        // together both run at once; the third waits until the debt is back to one request;
        // a burst request waits for all of it.
        let cap = CostVector::new(1_000, u64::MAX, u64::MAX, u64::MAX);
        let cost = CostVector::new(100, 0, 0, 0);
        let mut p = Pacer::new(0, cap);
        assert_eq!(p.ready_at(0, &cost, true), 0);
        p.take(0, &cost);
        assert_eq!(
            p.ready_at(0, &cost, true),
            0,
            "the second runs inside the first's debt"
        );
        assert_eq!(
            p.ready_at(0, &cost, false),
            100_000_000,
            "a burst request does not"
        );
        p.take(0, &cost);
        assert_eq!(
            p.ready_at(0, &cost, true),
            100_000_000,
            "the third waits for one request"
        );
        assert_eq!(p.ready_at(0, &cost, false), 200_000_000);
        // Over any interval: capacity x T plus one request plus the one admitted last.
        p.take(100_000_000, &cost);
        assert_eq!(p.ready_at(100_000_000, &cost, true), 200_000_000);
    }

    #[test]
    fn limiter_takes_the_longest_wait_of_both_dimensions() {
        let mut l = RateLimiter::new(0, IoRate::new(1_000, 4_096_000), 0);
        let c = Charge {
            units: 1,
            bytes: 8_192,
        };
        assert_eq!(l.ready_at(0, c), 0);
        l.take(0, c);
        // IOPS would allow 1 ms, bytes need (8192 - 1 + 1) / 4096000 s = 2 ms.
        assert_eq!(l.ready_at(0, c), 2_000_000);
        assert_eq!(depth_units(1_000, 10_000_000), 10);
        assert_eq!(depth_units(1, 10_000_000), 1);
    }

    #[test]
    fn new_credit_bucket_on_qos_change_starts_empty() {
        let mut c = VolumeCredits::new(0, &VolumeQos::default());
        assert!(!c.is_active());
        let qos = VolumeQos {
            burst: BurstMode::Credits(CreditSpec {
                iops: Some(CreditBucketSpec {
                    capacity: 100,
                    refill_per_s: 10,
                    start_full: true,
                }),
                bytes: None,
                pool: None,
            }),
            ..VolumeQos::default()
        };
        c.reconfigure(0, &qos);
        assert_eq!(c.balances_at(0), (Some(0), None));
        assert_eq!(c.balances_at(NS_PER_S), (Some(10), None));
    }

    #[test]
    fn restore_sets_existing_buckets_within_capacity_only() {
        let bucket = |capacity, start_full| CreditBucketSpec {
            capacity,
            refill_per_s: 10,
            start_full,
        };
        let qos = VolumeQos {
            burst: BurstMode::Credits(CreditSpec {
                iops: Some(bucket(100, true)),
                bytes: Some(bucket(1_000, false)),
                pool: None,
            }),
            ..VolumeQos::default()
        };
        let mut c = VolumeCredits::new(0, &qos);
        assert_eq!(c.balances_at(0), (Some(100), Some(0)));
        assert!(c.restore(0, Some(40), None));
        assert_eq!(c.balances_at(0), (Some(40), Some(0)));
        assert!(c.restore(0, None, Some(5_000)));
        assert_eq!(c.balances_at(0), (Some(40), Some(1_000)));
        assert!(!c.restore(0, None, None));
        assert!(c.within_range());
        // A volume without buckets ignores any value.
        let mut none = VolumeCredits::new(0, &VolumeQos::default());
        assert!(!none.restore(0, Some(1), Some(1)));
        assert_eq!(none.balances_at(0), (None, None));
    }

    #[test]
    fn pacer_admits_capacity_per_second_plus_one_request() {
        let mut p = Pacer::new(0, CostVector::new(1_000, u64::MAX, u64::MAX, u64::MAX));
        let cost = CostVector::new(300, 0, 0, 0);
        let mut now = 0;
        let mut n = 0;
        while now < NS_PER_S {
            now = p.ready_at(now, &cost, false);
            if now >= NS_PER_S {
                break;
            }
            p.take(now, &cost);
            n += 1;
        }
        // 1,000 cpu-ns per second of 300-ns requests: 4 requests start in the first second
        // (at 0, 0.3, 0.6, 0.9 s) -- capacity plus at most one request.
        assert_eq!(n, 4);
    }

    #[test]
    fn a_deep_pacer_catches_up_after_a_late_wake_up_and_no_further() {
        // 1,000 requests/s of 1 ms each; the caller looks only every 5 ms (a late timer).
        let cost = CostVector::new(1_000_000, 0, 0, 0);
        let capacity = CostVector::new(NS_PER_S, u64::MAX, u64::MAX, u64::MAX);
        let admitted_in_one_second = |mut p: Pacer| {
            let mut n = 0;
            let mut now = 0;
            while now < NS_PER_S {
                while p.ready_at(now, &cost, false) <= now {
                    p.take(now, &cost);
                    n += 1;
                }
                now += 5_000_000;
            }
            n
        };
        // No depth asked for: the pacer still saves up one request, so each look admits the
        // request saved up and one more into debt (the first look only one); the rest is lost.
        assert_eq!(admitted_in_one_second(Pacer::new(0, capacity)), 399);
        // 10 ms deep: the capacity that accrued between looks is made up, up to the last look
        // (at 995 ms: 995 requests' worth) plus the one request admitted into debt, and never
        // more.
        assert_eq!(
            admitted_in_one_second(Pacer::with_depth(0, capacity, 10_000_000)),
            996
        );
    }

    #[test]
    fn baseline_request_runs_inside_the_last_burst_requests_debt() {
        let mut p = Pacer::new(0, CostVector::new(1_000, u64::MAX, u64::MAX, u64::MAX));
        let big = CostVector::new(500, 0, 0, 0);
        let small = CostVector::new(100, 0, 0, 0);
        p.take(0, &big);
        // Burst traffic waits for the debt (0.5 s); baseline traffic does not.
        assert_eq!(p.ready_at(0, &small, false), 500_000_000);
        assert_eq!(p.ready_at(0, &small, true), 0);
        p.take(0, &small);
        // Baseline requests still pay: the next one waits for its own debt, burst ones longer.
        assert_eq!(p.ready_at(0, &small, true), 100_000_000);
        assert_eq!(p.ready_at(0, &small, false), 600_000_000);
        assert!(!p.idle_at(0));
    }
}
