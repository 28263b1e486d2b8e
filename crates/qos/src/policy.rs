//! The one scheduling interface every policy implements.
//!
//! Shaped after dmclock (docs/design.md principle 1): the caller owns time and passes it in as
//! `now_ns`; a policy never reads a clock, sleeps or spawns. The tokio server and the
//! discrete-event simulator drive the same implementation, so a simulated result is a result of
//! the shipped scheduler. Policies are chosen by configuration ([`PolicyKind`]) and compared on
//! the same work.

use crate::error::{InvariantViolation, QosError};
use crate::vocab::{Decision, IoRequest, NodeCapacity, Observed, Phase, VolumeId, VolumeQos};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A scheduler: decides, for each queued I/O, whether it runs now.
///
/// Contract for callers:
/// - `now_ns` never decreases between calls (a smaller value is treated as the last one seen);
/// - after `next` returns [`Decision::WaitUntil`]`(t)`, call `next` again at `t` or after any
///   `enqueue`, `complete`, QoS change or capacity change ([`Policy::set_capacity`]);
/// - a request for a volume that was never added is accepted and the volume is registered with
///   [`VolumeQos::default`] (best effort: no guarantee, no ceiling);
/// - `complete` is called once per dispatched request.
pub trait Policy: Send + fmt::Debug {
    /// Stable name (`wild`, `base`, `credit`, `burst`, `mclock`, `drr-vop`).
    fn name(&self) -> &'static str;
    /// Registers a volume (re-adding an existing volume behaves like `update_qos`).
    fn add_volume(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos);
    /// Changes a volume's QoS live. Credit balances are kept (clamped to a smaller bucket),
    /// never refilled: unlike QEMU, a QoS change does not hand out a fresh burst.
    fn update_qos(&mut self, now_ns: u64, id: VolumeId, qos: &VolumeQos);
    /// Restores a volume's persisted credit balances at `now_ns` (the server, after a restart).
    ///
    /// Each credit bucket the volume owns (burst mode [`crate::vocab::BurstMode::Credits`]
    /// without a pool) is set to `min(value, capacity)`, whether it started full or empty, and
    /// refills from there; `None` leaves that bucket unchanged. A value for a bucket the volume
    /// does not have, an unknown volume (which is *not* registered) and a policy without
    /// credit buckets (Wild, Base, mClock, DRR-VOP: the default) are no-ops. Pooled volumes
    /// (`CreditSpec::pool` set) are left alone too: the server does not persist pools yet, so
    /// a pool starts again from its one-time initial grant.
    fn restore_credits(
        &mut self,
        _now_ns: u64,
        _id: VolumeId,
        _iops_credits: Option<u64>,
        _bytes_credits: Option<u64>,
    ) {
    }
    /// Removes a volume; its queued requests are dropped (the caller fails them).
    fn remove_volume(&mut self, now_ns: u64, id: VolumeId);
    /// From `now_ns` on, schedules over `capacity` instead of the capacity it was built with (the
    /// node moves capacity between its workers: BurstCBS's shared global pool). Like every
    /// call, it only takes time as an argument (no clock, no sleep, no thread).
    ///
    /// - Every rate derived from the capacity changes at once: the node pacer (each dimension
    ///   keeps its current level, a debt included, clamped to its new depth: the change grants
    ///   no fresh capacity), Burst's burst pacer, per-window capacity and reserve, mClock's
    ///   pacer. Per-volume limiters, meters, credits and tags do not depend on the capacity
    ///   and are left alone.
    /// - Burst: the current window keeps the allocation it was given (loans, pool and reserve;
    ///   on a decrease the unlent pool and the reserve are clamped to the new window's), so a
    ///   window never dispatches more than the larger of its old and new capacity; the next
    ///   window's allocation (round 1 baselines, round 2 lending, the reserve) uses the new
    ///   capacity. A window that began before the change is closed first, with the capacity
    ///   in effect when it began.
    /// - Invariants ([`Policy::check_invariants`]): the capacity per window is checked against
    ///   the largest capacity in effect at any time during that window, per dimension (the
    ///   same for Burst's allocation sum); the baseline guarantee is checked while the capacity
    ///   now in effect covers the baselines, and after a period in which it did not, a request
    ///   is owed its baseline from the change that ended that period; its grace (one window
    ///   plus one request per volume) is timed at the smallest capacity in effect since it
    ///   became due.
    /// - The same capacity again is a no-op (no state reset, no refill); a component of
    ///   `u64::MAX` is unlimited, as in [`build_policy`]. A dimension going from unlimited to
    ///   limited starts full (at its depth: nothing for a pacer without depth).
    /// - Cost: O(1) in the number of volumes (O(dimensions)); the engine-based policies may run
    ///   the window allocation that was due anyway at `now_ns` first.
    ///
    /// After a change, `next` may dispatch earlier (or later) than its last
    /// [`Decision::WaitUntil`] said: call it again.
    fn set_capacity(&mut self, now_ns: u64, capacity: NodeCapacity);
    /// Queues a request.
    fn enqueue(&mut self, now_ns: u64, req: IoRequest);
    /// Picks the next request to run, or says when to ask again.
    fn next(&mut self, now_ns: u64) -> Decision;
    /// Reports that a dispatched request finished (feeds online cost correction).
    fn complete(&mut self, now_ns: u64, req: &IoRequest, observed: Observed);
    /// Checks every invariant of the policy (tests call it after every step).
    fn check_invariants(&self) -> Result<(), InvariantViolation>;
    /// Number of requests queued (not yet dispatched) over all volumes.
    fn queued_requests(&self) -> usize;
    /// Observable state of one volume, for metrics and the preview.
    fn snapshot(&self, id: VolumeId) -> Option<VolumeSnapshot>;
}

/// Observable per-volume state of a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSnapshot {
    /// Requests queued, not yet dispatched.
    pub queued_requests: usize,
    /// Whole credits in the IOPS bucket, if the volume has one (Credit and Burst policies).
    pub iops_credits: Option<u64>,
    /// Whole credits (bytes) in the throughput bucket, if the volume has one.
    pub bytes_credits: Option<u64>,
    /// Requests dispatched so far, per phase in [`Phase::ALL`] order.
    pub dispatched_requests: [u64; 3],
    /// Payload bytes dispatched so far, per phase in [`Phase::ALL`] order.
    pub dispatched_bytes: [u64; 3],
}

impl VolumeSnapshot {
    /// Requests dispatched in one phase.
    pub fn dispatched_in(&self, phase: Phase) -> u64 {
        self.dispatched_requests[phase as usize]
    }
}

/// Which policy to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PolicyKind {
    /// WildCBS: weighted round robin with per-volume ceilings, work-conserving, no isolation.
    Wild,
    /// BaseCBS: static caps at the baseline (Gimbal-like), no burst.
    Base,
    /// Token-bucket bursting per the volume's credit buckets (gp2 / Azure / QEMU semantics).
    Credit,
    /// BurstCBS: per-window prediction, lending, fast recovery and a reserve.
    Burst,
    /// mClock: reservation, weight and limit tags.
    MClock,
    /// Libra: deficit round robin charged in virtual IOPs (device units).
    DrrVop,
}

impl PolicyKind {
    /// All policies, in a stable order.
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Wild,
        PolicyKind::Base,
        PolicyKind::Credit,
        PolicyKind::Burst,
        PolicyKind::MClock,
        PolicyKind::DrrVop,
    ];

    /// The name accepted by [`FromStr`].
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Wild => "wild",
            PolicyKind::Base => "base",
            PolicyKind::Credit => "credit",
            PolicyKind::Burst => "burst",
            PolicyKind::MClock => "mclock",
            PolicyKind::DrrVop => "drr-vop",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = QosError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('_', "-");
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == norm || (norm == "drrvop" && *k == PolicyKind::DrrVop))
            .ok_or_else(|| QosError::UnknownPolicy(s.to_string()))
    }
}

/// Tunables of the policies. The papers leave these open; `docs/qos.md` justifies the defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyParams {
    /// Length of one scheduling window (Burst allocation cycle, invariant accounting), ns.
    pub window_ns: u64,
    /// How much service a per-volume limiter saves up for a volume that was held back (by
    /// the node, by its neighbours' turns), ns of its rate; also the largest burst above a
    /// rate after idleness. 0 = one request.
    pub limiter_depth_ns: u64,
    /// How much unused node capacity the node pacer may save up, ns of capacity; it always
    /// may save up the largest request it admitted (see [`crate::limiter::Pacer`]), so 0 =
    /// one request. A live server wants more (the server uses 1 ms): its timers wake tens of
    /// µs late, and every late wake-up beyond the depth is capacity lost for good. The
    /// simulator's workers are late only by their own CPU work and keep 0.
    pub pacer_depth_ns: u64,
    /// Burst: number of past windows the usage prediction looks at (N).
    pub history_windows: u32,
    /// Burst: headroom multiplier on the predicted usage (alpha), in thousandths.
    pub alpha_permille: u32,
    /// Burst: extra weight of a throttled request when lending spare capacity, in thousandths.
    pub throttle_weight_permille: u32,
    /// Burst: share of capacity held back for fast recovery, in thousandths (50 = 5 %).
    pub reserve_permille: u32,
    /// DRR-VOP: quantum added per round, in device units, per unit of weight.
    pub drr_quantum_device_units: u64,
    /// Seed of the deterministic choice source (Burst's power-of-two-choices donor).
    pub seed: u64,
    /// Track per-volume invariants (ceiling per window, baseline guarantee) for
    /// [`Policy::check_invariants`]. Verification, not scheduling: turning it off changes no
    /// decision, makes `complete` O(1) without touching the volume, and keeps each volume's
    /// state smaller; `check_invariants` then checks only the node-wide invariants
    /// (accounting, capacity per window, work conservation, policy-specific ones).
    pub track_invariants: bool,
    /// How far past a volume's head request the ring-based policies may look for a request
    /// that needs none of the capacity dimensions the head waits for (a read waiting for
    /// egress lets the volume's next write use ingress); that request then runs first. NBD
    /// replies may come in any order, so the server does not need a volume's requests run in
    /// arrival order. 0 keeps arrival order within each volume (other volumes still pass a
    /// waiting one).
    pub reorder_lookahead: u32,
}

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams {
            window_ns: 10_000_000,
            limiter_depth_ns: 10_000_000,
            pacer_depth_ns: 0,
            history_windows: 8,
            alpha_permille: 1_250,
            throttle_weight_permille: 4_000,
            reserve_permille: 50,
            drr_quantum_device_units: 100_000,
            seed: 0x5eed_1234_abcd_ef01,
            track_invariants: true,
            reorder_lookahead: 16,
        }
    }
}

/// Largest [`PolicyParams::reorder_lookahead`]: the look past a head request is a scan of
/// the volume's queue, so it is bounded.
pub const MAX_REORDER_LOOKAHEAD: u32 = 256;

impl PolicyParams {
    /// Checks ranges; [`build_policy`] clamps instead of failing, this tells the caller why.
    pub fn validate(&self) -> Result<(), QosError> {
        if self.window_ns < 100_000 || self.window_ns > 10_000_000_000 {
            return Err(QosError::InvalidParams(format!(
                "window_ns {} outside [100 us, 10 s]",
                self.window_ns
            )));
        }
        if self.limiter_depth_ns > 10_000_000_000 {
            return Err(QosError::InvalidParams(format!(
                "limiter_depth_ns {} above 10 s",
                self.limiter_depth_ns
            )));
        }
        if self.pacer_depth_ns > self.window_ns {
            return Err(QosError::InvalidParams(format!(
                "pacer_depth_ns {} above the window ({} ns)",
                self.pacer_depth_ns, self.window_ns
            )));
        }
        if self.history_windows == 0 || self.history_windows > 1024 {
            return Err(QosError::InvalidParams(format!(
                "history_windows {} outside [1, 1024]",
                self.history_windows
            )));
        }
        if self.alpha_permille < 1_000 || self.alpha_permille > 10_000 {
            return Err(QosError::InvalidParams(format!(
                "alpha_permille {} outside [1000, 10000]",
                self.alpha_permille
            )));
        }
        if self.throttle_weight_permille > 100_000 {
            return Err(QosError::InvalidParams(format!(
                "throttle_weight_permille {} above 100000",
                self.throttle_weight_permille
            )));
        }
        if self.reserve_permille >= 500 {
            return Err(QosError::InvalidParams(format!(
                "reserve_permille {} must be < 500",
                self.reserve_permille
            )));
        }
        if self.drr_quantum_device_units == 0 {
            return Err(QosError::InvalidParams(
                "drr_quantum_device_units must be > 0".into(),
            ));
        }
        if self.reorder_lookahead > MAX_REORDER_LOOKAHEAD {
            return Err(QosError::InvalidParams(format!(
                "reorder_lookahead {} above {MAX_REORDER_LOOKAHEAD}",
                self.reorder_lookahead
            )));
        }
        Ok(())
    }

    /// A copy with every field clamped into its valid range.
    pub fn clamped(&self) -> PolicyParams {
        PolicyParams {
            window_ns: self.window_ns.clamp(100_000, 10_000_000_000),
            limiter_depth_ns: self.limiter_depth_ns.min(10_000_000_000),
            pacer_depth_ns: self
                .pacer_depth_ns
                .min(self.window_ns.clamp(100_000, 10_000_000_000)),
            history_windows: self.history_windows.clamp(1, 1024),
            alpha_permille: self.alpha_permille.clamp(1_000, 10_000),
            throttle_weight_permille: self.throttle_weight_permille.min(100_000),
            reserve_permille: self.reserve_permille.min(499),
            drr_quantum_device_units: self.drr_quantum_device_units.max(1),
            seed: self.seed,
            track_invariants: self.track_invariants,
            reorder_lookahead: self.reorder_lookahead.min(MAX_REORDER_LOOKAHEAD),
        }
    }
}

/// Builds a policy. Out-of-range parameters are clamped (see [`PolicyParams::validate`]).
pub fn build_policy(
    kind: PolicyKind,
    capacity: NodeCapacity,
    params: &PolicyParams,
) -> Box<dyn Policy> {
    let params = params.clamped();
    crate::policies::build(kind, capacity, &params)
}
