//! The burst gate's rules: how much burst work may be in flight at a device so that baseline
//! requests always find a channel (decision 10 of the architecture).
//!
//! Why here: the node's scheduler applies them to live requests (`node::scheduler::gate`
//! keeps the queues and the locking), and the simulator must be able to apply the very same
//! rules to its requests; both are pure, so they live in this crate. The rules:
//! - the gate's size is `burst_in_flight`, or the device's parallelism less one channel kept
//!   for baseline work, at least one; no gate for the reference policy without isolation
//!   (`wild`), for `0`, or when neither is known ([`gate_limit`]);
//! - a baseline request of a volume that is not bursting passes at once and is counted as
//!   *protected*; a burst request, and a baseline request of a volume that is bursting, is
//!   *bursting* ([`GateSlot::of`]);
//! - a bursting request starts only while fewer than `limit` bursting requests are in flight
//!   and bursting plus protected ones are at most `limit`: burst work keeps one of the
//!   device's `limit + 1` channels for baseline work and never makes the device queue
//!   ([`GateCounts::bursting_fits`]).

/// How the gate counts a request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateSlot {
    /// Not counted (no gate, an orphan, or not yet admitted).
    Outside,
    /// A baseline request of a volume that is not bursting.
    Protected,
    /// A burst request, or a baseline request of a bursting volume.
    Bursting,
}

impl GateSlot {
    /// The class of a request: `burst` (dispatched above its baseline) or a baseline request
    /// of a volume with `volume_bursting` bursting requests waiting or in flight.
    pub fn of(burst: bool, volume_bursting: usize) -> GateSlot {
        if !burst && volume_bursting == 0 {
            GateSlot::Protected
        } else {
            GateSlot::Bursting
        }
    }
}

/// The gate's size: most bursting requests in flight, `None` for no gate. `isolates`: the
/// policy isolates tenants (every policy but `wild`).
pub fn gate_limit(
    burst_in_flight: Option<u32>,
    device_parallelism: Option<u32>,
    isolates: bool,
) -> Option<usize> {
    match burst_in_flight.or_else(|| device_parallelism.map(|p| p.saturating_sub(1).max(1))) {
        Some(n) if n > 0 && isolates => usize::try_from(n).ok(),
        _ => None,
    }
}

/// The requests the gate counts in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateCounts {
    pub protected: usize,
    pub bursting: usize,
}

impl GateCounts {
    /// Whether one more bursting request may start under a gate of `limit`.
    pub fn bursting_fits(&self, limit: usize) -> bool {
        self.bursting < limit && self.bursting + self.protected <= limit
    }

    /// A request of `slot` starts.
    pub fn start(&mut self, slot: GateSlot) {
        match slot {
            GateSlot::Protected => self.protected += 1,
            GateSlot::Bursting => self.bursting += 1,
            GateSlot::Outside => {}
        }
    }

    /// A request of `slot` completed.
    pub fn finish(&mut self, slot: GateSlot) {
        match slot {
            GateSlot::Protected => {
                debug_assert!(self.protected > 0, "a protected request finished twice");
                self.protected = self.protected.saturating_sub(1);
            }
            GateSlot::Bursting => {
                debug_assert!(self.bursting > 0, "a bursting request finished twice");
                self.bursting = self.bursting.saturating_sub(1);
            }
            GateSlot::Outside => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_keeps_a_channel_for_baseline_work_and_wild_never_gates() {
        assert_eq!(gate_limit(None, Some(4), true), Some(3));
        assert_eq!(gate_limit(None, Some(1), true), Some(1));
        assert_eq!(gate_limit(Some(2), Some(8), true), Some(2));
        assert_eq!(gate_limit(Some(0), Some(8), true), None);
        assert_eq!(gate_limit(None, None, true), None);
        assert_eq!(gate_limit(None, Some(4), false), None);
    }

    #[test]
    fn bursting_work_never_fills_the_device_and_baseline_work_passes() {
        assert_eq!(GateSlot::of(false, 0), GateSlot::Protected);
        assert_eq!(GateSlot::of(false, 1), GateSlot::Bursting);
        assert_eq!(GateSlot::of(true, 0), GateSlot::Bursting);
        // A device of 4 channels: a gate of 3.
        let mut counts = GateCounts::default();
        for _ in 0..3 {
            assert!(counts.bursting_fits(3));
            counts.start(GateSlot::Bursting);
        }
        assert!(
            !counts.bursting_fits(3),
            "three bursting: the fourth channel is kept"
        );
        counts.finish(GateSlot::Bursting);
        counts.start(GateSlot::Protected);
        counts.start(GateSlot::Protected);
        // Two bursting and two protected in flight: one more would make the device queue.
        assert!(!counts.bursting_fits(3));
        counts.finish(GateSlot::Protected);
        assert!(counts.bursting_fits(3));
    }
}
