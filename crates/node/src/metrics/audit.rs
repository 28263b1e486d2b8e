//! The promise audit: per volume, the seconds in which the node served it less than its
//! baseline although it asked for at least that much (the node's fault), with the shortfall,
//! and apart from those the seconds in which it was held by its own ceiling or empty credits.
//!
//! Why: a baseline is a promise, and an operator (or a tenant) should be able to see whether
//! it was kept without running a benchmark. The definitions (docs/operations.md, "Promise
//! audit") are judged per one-second window of the node's clock:
//!
//! - *served*: requests whose reply was handed to the writer in the window, and their
//!   payload bytes;
//! - *offered*: requests that arrived in the window plus those already outstanding (arrived,
//!   not yet answered) at its start, and their payload bytes;
//! - *backlogged*: the volume had at least one request outstanding for at least 90 % of the
//!   window (a client that always waits for the node wants more than it gets; this is how a
//!   closed-loop client such as fio at a fixed queue depth shows its demand, since its
//!   arrivals can never exceed what it is served);
//! - the window is *short* when the volume has a baseline, its demand reached it (offered ≥
//!   baseline in a dimension with a baseline, or backlogged), and in every dimension with a
//!   baseline it was served less than 95 % of the baseline (a baseline is a pair of limits:
//!   reaching one of them is the promise kept). The shortfall is what it would have been
//!   served more at its own request mix had it reached the nearer of its baselines
//!   (`served × (1 − f) / f`, `f` = served / baseline in that dimension; for an IOPS-only
//!   baseline simply baseline − served);
//! - the window is *own-limit* when it is not short, requests of the volume were held back by
//!   the scheduler, and in some dimension it was served at least 90 % of its own cap in
//!   force: its ceiling, or its baseline when it cannot burst (burst `none`) or its credit
//!   bucket was empty (under 1 % of its capacity) when the window closed.
//!
//! Windows close lazily: the first request event (arrival or reply) in a later second closes
//! the open window under this volume's mutex, and so does every read (`/metrics`, `volume
//! show`), so seconds of a volume that went idle are counted when someone looks. Seconds with
//! no event at all in between are judged as they were: with requests outstanding (a stalled
//! node) each such second is short by the whole baseline; with none, idle.
//!
//! Hot path per request: the outstanding count (one `fetch_add`/`fetch_sub`), the arriving
//! payload bytes, and on a transition to or from idle one more atomic; comparing the clock
//! with the window's end decides whether to close (once per second).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use headroom_qos::{BurstMode, VolumeQos};
use serde::{Deserialize, Serialize};

use super::{MetricsRegistry, VolumeStats};

use crate::sync::lock;

const NS_PER_S: u64 = 1_000_000_000;
/// A window is backlogged when the volume was idle (nothing outstanding) less than this.
const BACKLOGGED_MAX_IDLE_NS: u64 = NS_PER_S / 10;
/// Served below this share of the baseline (permille) is short.
pub const SHORT_BELOW_PERMILLE: u64 = 950;
/// Served at least this share of the cap in force (permille) is at its own limit.
pub const OWN_LIMIT_FROM_PERMILLE: u64 = 900;
/// Most silent windows judged one by one when closing (the rest are counted in bulk).
const MAX_SILENT_WINDOWS: u64 = u64::MAX / (2 * NS_PER_S);

/// The audit's totals, as `GET /v1/volumes/{name}` and `/metrics` show them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditView {
    /// Seconds in which the volume's demand reached its baseline but it was served less.
    pub short_seconds: u64,
    /// I/Os (requests) it would have been served more in those seconds.
    pub shortfall_ops: u64,
    /// Payload bytes it would have been served more in those seconds.
    pub shortfall_bytes: u64,
    /// Seconds (not short) in which it was held at its own ceiling or empty credits.
    pub own_limit_seconds: u64,
    /// Seconds judged (windows closed with the volume known).
    pub seconds_judged: u64,
}

#[derive(Debug)]
pub(super) struct Audit {
    /// Requests arrived and not yet answered.
    outstanding: AtomicU64,
    /// Payload bytes of every request that arrived.
    arrived_bytes: AtomicU64,
    /// When `outstanding` last fell to 0 (ns, node clock); meaningful while it is 0.
    idle_since_ns: AtomicU64,
    /// Idle time of the idle periods that have ended (ns).
    idle_ns: AtomicU64,
    /// End of the open window (ns, a whole second).
    window_end_ns: AtomicU64,
    /// Second (node clock) of the last request arrival.
    last_active_s: AtomicU64,
    state: Mutex<AuditState>,
    short_seconds: AtomicU64,
    shortfall_ops: AtomicU64,
    shortfall_bytes: AtomicU64,
    own_limit_seconds: AtomicU64,
    seconds_judged: AtomicU64,
}

/// The counts at the start of the open window, and the QoS judged by.
#[derive(Debug)]
struct AuditState {
    qos: VolumeQos,
    served_ops: u64,
    served_bytes: u64,
    idle_ns: u64,
    throttled_ios: u64,
}

/// A baseline or cap dimension: finite and non-zero.
fn finite(rate: u64) -> Option<u64> {
    (rate > 0 && rate != u64::MAX).then_some(rate)
}

/// What one window looked like.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Window {
    pub served_ops: u64,
    pub served_bytes: u64,
    pub offered_ops: u64,
    pub offered_bytes: u64,
    pub idle_ns: u64,
    /// Requests the scheduler held back (completed in the window).
    pub held_ops: u64,
    /// The credit bucket was empty when the window closed.
    pub credits_empty: bool,
}

/// How a window is judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// No baseline, no demand, or served enough, and not at its own cap.
    Fine,
    Short {
        ops: u64,
        bytes: u64,
    },
    OwnLimit,
}

/// Judges one window against `qos` (module doc).
pub(crate) fn judge(qos: &VolumeQos, w: &Window) -> Verdict {
    let base_ops = finite(qos.baseline.iops);
    let base_bytes = finite(qos.baseline.bytes_per_s);
    if base_ops.is_some() || base_bytes.is_some() {
        let backlogged = w.idle_ns < BACKLOGGED_MAX_IDLE_NS;
        let demand = (backlogged && w.offered_ops > 0)
            || base_ops.is_some_and(|b| w.offered_ops >= b)
            || base_bytes.is_some_and(|b| w.offered_bytes >= b);
        // f: how far toward the nearer baseline it was served (1.0 = reached it).
        let ratio = |served: u64, base: Option<u64>| base.map(|b| served as f64 / b as f64);
        let f = [
            ratio(w.served_ops, base_ops),
            ratio(w.served_bytes, base_bytes),
        ]
        .into_iter()
        .flatten()
        .fold(0.0f64, f64::max);
        if demand && f * 1000.0 < SHORT_BELOW_PERMILLE as f64 {
            let (ops, bytes) = if w.served_ops > 0 && f > 0.0 {
                let more = (1.0 - f) / f;
                (
                    (w.served_ops as f64 * more).round() as u64,
                    (w.served_bytes as f64 * more).round() as u64,
                )
            } else {
                // Nothing served: the baseline, at the offered request size.
                let size = w.offered_bytes.checked_div(w.offered_ops).unwrap_or(0);
                match (base_ops, base_bytes) {
                    (Some(ops), Some(bytes)) => (ops, bytes.min(ops.saturating_mul(size))),
                    (Some(ops), None) => (ops, ops.saturating_mul(size)),
                    (None, Some(bytes)) => (bytes.checked_div(size).unwrap_or(0), bytes),
                    (None, None) => (0, 0),
                }
            };
            return Verdict::Short { ops, bytes };
        }
    }
    if w.held_ops == 0 {
        return Verdict::Fine;
    }
    let reached = |served: u64, cap: u64| {
        finite(cap).is_some_and(|cap| served.saturating_mul(1000) >= cap * OWN_LIMIT_FROM_PERMILLE)
    };
    let at = |rate: headroom_qos::IoRate| {
        reached(w.served_ops, rate.iops) || reached(w.served_bytes, rate.bytes_per_s)
    };
    let baseline_is_cap = match qos.burst {
        BurstMode::None => true,
        BurstMode::Credits(_) => w.credits_empty,
        BurstMode::OnDemand => false,
    };
    if at(qos.ceiling) || (baseline_is_cap && at(qos.baseline)) {
        Verdict::OwnLimit
    } else {
        Verdict::Fine
    }
}

impl Audit {
    pub(super) fn new(qos: &VolumeQos, now_ns: u64) -> Audit {
        Audit {
            outstanding: AtomicU64::new(0),
            arrived_bytes: AtomicU64::new(0),
            // Before the volume was known it was idle: its first window starts idle.
            idle_since_ns: AtomicU64::new(now_ns / NS_PER_S * NS_PER_S),
            idle_ns: AtomicU64::new(0),
            window_end_ns: AtomicU64::new((now_ns / NS_PER_S + 1) * NS_PER_S),
            last_active_s: AtomicU64::new(0),
            state: Mutex::new(AuditState {
                qos: *qos,
                served_ops: 0,
                served_bytes: 0,
                idle_ns: 0,
                throttled_ios: 0,
            }),
            short_seconds: AtomicU64::new(0),
            shortfall_ops: AtomicU64::new(0),
            shortfall_bytes: AtomicU64::new(0),
            own_limit_seconds: AtomicU64::new(0),
            seconds_judged: AtomicU64::new(0),
        }
    }

    pub(super) fn qos(&self) -> VolumeQos {
        lock(&self.state).qos
    }

    pub(super) fn set_qos(&self, qos: &VolumeQos) {
        lock(&self.state).qos = *qos;
    }

    #[inline]
    pub(super) fn arrive(&self, now_ns: u64, payload_bytes: u64) {
        // A load per request, a store once per second.
        let now_s = now_ns / NS_PER_S;
        if self.last_active_s.load(Ordering::Relaxed) != now_s {
            self.last_active_s.store(now_s, Ordering::Relaxed);
        }
        if payload_bytes > 0 {
            self.arrived_bytes
                .fetch_add(payload_bytes, Ordering::Relaxed);
        }
        if self.outstanding.fetch_add(1, Ordering::Relaxed) == 0 {
            let since = self.idle_since_ns.load(Ordering::Relaxed);
            self.idle_ns
                .fetch_add(now_ns.saturating_sub(since), Ordering::Relaxed);
        }
    }

    #[inline]
    pub(super) fn depart(&self, now_ns: u64) {
        if self.outstanding.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.idle_since_ns.store(now_ns, Ordering::Relaxed);
        }
    }

    pub(super) fn last_active_s(&self) -> u64 {
        self.last_active_s.load(Ordering::Relaxed)
    }

    /// Closes the open window if `now_ns` is past its end.
    #[inline]
    pub(super) fn close_due(&self, stats: &VolumeStats, registry: &MetricsRegistry, now_ns: u64) {
        if now_ns >= self.window_end_ns.load(Ordering::Relaxed) {
            self.close(stats, registry, now_ns);
        }
    }

    #[cold]
    fn close(&self, stats: &VolumeStats, registry: &MetricsRegistry, now_ns: u64) {
        let mut state = lock(&self.state);
        let end_ns = self.window_end_ns.load(Ordering::Relaxed);
        if now_ns < end_ns {
            return; // Someone else closed it.
        }
        let start_ns = end_ns - NS_PER_S;
        let (served_ops, served_bytes) = stats.served();
        let outstanding = self.outstanding.load(Ordering::Relaxed);
        let arrived_ops = served_ops.saturating_add(outstanding);
        let arrived_bytes = self.arrived_bytes.load(Ordering::Relaxed);
        let idle_total = self.idle_ns.load(Ordering::Relaxed);
        let mut idle_in_window = idle_total.saturating_sub(state.idle_ns);
        if outstanding == 0 {
            let since = self.idle_since_ns.load(Ordering::Relaxed).max(start_ns);
            idle_in_window = idle_in_window.saturating_add(end_ns.saturating_sub(since));
            // The rest of this idle period is counted from the window's end.
            self.idle_since_ns.fetch_max(end_ns, Ordering::Relaxed);
        }
        // Own-limit needs the scheduler: requests it held, and the credit balance.
        let (throttled_ios, credits_empty) = match registry.scheduler() {
            Some(scheduler) => match scheduler.volume_handle(stats.key) {
                Some(handle) => {
                    let held = handle.counters.throttled_ios.load(Ordering::Relaxed);
                    let empty = match &state.qos.burst {
                        BurstMode::Credits(spec) => {
                            let (iops, bytes) = scheduler.volume_credits(&handle);
                            let low = |bal: Option<u64>, cap: Option<u64>| match (bal, cap) {
                                (Some(bal), Some(cap)) => bal <= cap / 100,
                                _ => false,
                            };
                            low(iops, spec.iops.map(|b| b.capacity))
                                || low(bytes, spec.bytes.map(|b| b.capacity))
                        }
                        _ => false,
                    };
                    (held, empty)
                }
                None => (state.throttled_ios, false),
            },
            None => (state.throttled_ios, false),
        };
        let window = Window {
            served_ops: served_ops.saturating_sub(state.served_ops),
            served_bytes: served_bytes.saturating_sub(state.served_bytes),
            offered_ops: arrived_ops.saturating_sub(state.served_ops),
            offered_bytes: arrived_bytes.saturating_sub(state.served_bytes),
            idle_ns: idle_in_window.min(NS_PER_S),
            held_ops: throttled_ios.saturating_sub(state.throttled_ios),
            credits_empty,
        };
        self.record(judge(&state.qos, &window), 1);
        // Seconds with no event at all: nothing served, the same requests outstanding.
        let now_s = now_ns / NS_PER_S;
        let silent = now_s
            .saturating_sub(end_ns / NS_PER_S)
            .min(MAX_SILENT_WINDOWS);
        if silent > 0 {
            let quiet = Window {
                offered_ops: outstanding,
                idle_ns: if outstanding == 0 { NS_PER_S } else { 0 },
                credits_empty,
                ..Window::default()
            };
            self.record(judge(&state.qos, &quiet), silent);
        }
        state.served_ops = served_ops;
        state.served_bytes = served_bytes;
        state.idle_ns = idle_total;
        state.throttled_ios = throttled_ios;
        self.window_end_ns
            .store((now_s + 1) * NS_PER_S, Ordering::Relaxed);
    }

    fn record(&self, verdict: Verdict, windows: u64) {
        self.seconds_judged.fetch_add(windows, Ordering::Relaxed);
        match verdict {
            Verdict::Fine => {}
            Verdict::Short { ops, bytes } => {
                self.short_seconds.fetch_add(windows, Ordering::Relaxed);
                self.shortfall_ops
                    .fetch_add(ops.saturating_mul(windows), Ordering::Relaxed);
                self.shortfall_bytes
                    .fetch_add(bytes.saturating_mul(windows), Ordering::Relaxed);
            }
            Verdict::OwnLimit => {
                self.own_limit_seconds.fetch_add(windows, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn view(&self) -> AuditView {
        AuditView {
            short_seconds: self.short_seconds.load(Ordering::Relaxed),
            shortfall_ops: self.shortfall_ops.load(Ordering::Relaxed),
            shortfall_bytes: self.shortfall_bytes.load(Ordering::Relaxed),
            own_limit_seconds: self.own_limit_seconds.load(Ordering::Relaxed),
            seconds_judged: self.seconds_judged.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_qos::IoRate;

    fn qos(baseline_iops: u64, ceiling_iops: u64, burst: BurstMode) -> VolumeQos {
        VolumeQos {
            baseline: IoRate::new(baseline_iops, u64::MAX),
            ceiling: IoRate::new(ceiling_iops, u64::MAX),
            burst,
            ..VolumeQos::default()
        }
    }

    fn window(served: u64, offered: u64, idle_ms: u64, held: u64) -> Window {
        Window {
            served_ops: served,
            served_bytes: served * 4096,
            offered_ops: offered,
            offered_bytes: offered * 4096,
            idle_ns: idle_ms * 1_000_000,
            held_ops: held,
            credits_empty: false,
        }
    }

    #[test]
    fn short_needs_demand_and_less_than_the_baseline() {
        let q = qos(1000, u64::MAX, BurstMode::OnDemand);
        // Open loop: 1200 offered, 600 served.
        assert_eq!(
            judge(&q, &window(600, 1200, 500, 0)),
            Verdict::Short {
                ops: 400,
                bytes: 400 * 4096
            }
        );
        // Closed loop: arrivals never exceed service, but it always waited for the node.
        assert!(matches!(
            judge(&q, &window(600, 632, 0, 0)),
            Verdict::Short { ops: 400, .. }
        ));
        // Asked for less than the baseline and sometimes idle: no promise broken.
        assert_eq!(judge(&q, &window(600, 600, 400, 0)), Verdict::Fine);
        // Within 5 % of the baseline.
        assert_eq!(judge(&q, &window(960, 2000, 0, 0)), Verdict::Fine);
        // No baseline, no promise.
        let none = qos(0, u64::MAX, BurstMode::OnDemand);
        assert_eq!(judge(&none, &window(10, 5000, 0, 0)), Verdict::Fine);
    }

    #[test]
    fn a_volume_held_at_its_own_cap_is_own_limit_not_short() {
        let q = qos(1000, 3000, BurstMode::OnDemand);
        assert_eq!(judge(&q, &window(2950, 5000, 0, 100)), Verdict::OwnLimit);
        // Not held: just fast.
        assert_eq!(judge(&q, &window(2950, 2950, 0, 0)), Verdict::Fine);
        // Held at the baseline with burst on spare capacity: the node had no spare; not its
        // own limit, and not short either.
        assert_eq!(judge(&q, &window(1000, 5000, 0, 100)), Verdict::Fine);
        // With credits, empty credits make the baseline its cap.
        let spec = headroom_qos::CreditSpec {
            iops: Some(headroom_qos::CreditBucketSpec {
                capacity: 100_000,
                refill_per_s: 1000,
                start_full: true,
            }),
            bytes: None,
            pool: None,
        };
        let c = qos(1000, 3000, BurstMode::Credits(spec));
        let mut w = window(1000, 5000, 0, 100);
        assert_eq!(judge(&c, &w), Verdict::Fine);
        w.credits_empty = true;
        assert_eq!(judge(&c, &w), Verdict::OwnLimit);
    }

    #[test]
    fn nothing_served_is_short_by_the_whole_baseline() {
        let q = qos(1000, u64::MAX, BurstMode::None);
        assert_eq!(
            judge(&q, &window(0, 32, 0, 0)),
            Verdict::Short {
                ops: 1000,
                bytes: 1000 * 4096
            }
        );
    }
}
