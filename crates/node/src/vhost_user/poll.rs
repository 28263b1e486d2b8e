//! Adaptive polling of a virtqueue: after a queue is drained, the event thread keeps looking
//! at the ring for a while before it asks the driver for kicks again.
//!
//! Why: a kick is a write to an eventfd by the frontend (for a KVM guest, a VM exit first)
//! and a wake-up of the event thread here; a driver that keeps sending finds its next chain
//! taken without either while the backend polls, since with kicks left off (EVENT_IDX's
//! `avail_event` not moved on, or `VRING_USED_F_NO_NOTIFY`) the driver does not kick. The
//! price is the CPU the spinning burns, so the window adapts as QEMU's event loop does
//! (`poll-max-ns`, `poll-grow`, `poll-shrink`): a look that finds chains doubles it, up to
//! the attachment's `poll_us`; one that finds nothing halves it, down to a floor of
//! `1/64` of the maximum. Off (`poll_us` 0) is pure event mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Largest polling window an attachment may ask for: a millisecond of spinning per drain.
pub const MAX_POLL_US: u32 = 1_000;

/// The smallest window is the largest divided by this.
const SHRINK_FLOOR_DIVISOR: u64 = 64;

/// One queue's polling window.
#[derive(Debug)]
pub(super) struct PollWindow {
    max_ns: u64,
    window_ns: AtomicU64,
}

impl PollWindow {
    /// A window of at most `max_us` (0: never poll), starting at the largest.
    pub(super) fn new(max_us: u32) -> PollWindow {
        assert!(max_us <= MAX_POLL_US, "a polling window of {max_us} µs");
        let max_ns = u64::from(max_us) * 1_000;
        PollWindow {
            max_ns,
            window_ns: AtomicU64::new(max_ns),
        }
    }

    /// The window now, ns.
    pub(super) fn window_ns(&self) -> u64 {
        self.window_ns.load(Ordering::Relaxed)
    }

    /// Spins for at most the window until `has_work` says there is something; whether it
    /// did. The window grows when it did and shrinks when it did not.
    pub(super) fn spin(&self, mut has_work: impl FnMut() -> bool) -> bool {
        if self.max_ns == 0 {
            return false;
        }
        let window_ns = self.window_ns();
        let window = Duration::from_nanos(window_ns);
        let started = Instant::now();
        loop {
            if has_work() {
                self.window_ns.store(
                    window_ns.saturating_mul(2).min(self.max_ns),
                    Ordering::Relaxed,
                );
                return true;
            }
            if started.elapsed() >= window {
                let floor_ns = (self.max_ns / SHRINK_FLOOR_DIVISOR).max(1);
                self.window_ns
                    .store((window_ns / 2).max(floor_ns), Ordering::Relaxed);
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_looks() {
        let poll = PollWindow::new(0);
        let mut looked = 0;
        assert!(!poll.spin(|| {
            looked += 1;
            true
        }));
        assert_eq!(looked, 0);
    }

    #[test]
    fn work_found_grows_the_window_to_the_maximum_and_none_shrinks_it_to_the_floor() {
        let poll = PollWindow::new(64);
        assert_eq!(poll.window_ns(), 64_000);
        // Nothing to find: each empty look halves the window, down to 1/64 of the maximum.
        for expected_ns in [32_000, 16_000, 8_000, 4_000, 2_000, 1_000, 1_000] {
            assert!(!poll.spin(|| false));
            assert_eq!(poll.window_ns(), expected_ns);
        }
        // Work on the third look: the window doubles, up to the maximum.
        for expected_ns in [2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 64_000] {
            let mut looks = 0;
            assert!(poll.spin(|| {
                looks += 1;
                looks == 3
            }));
            assert_eq!(looks, 3);
            assert_eq!(poll.window_ns(), expected_ns);
        }
    }

    #[test]
    #[should_panic(expected = "a polling window of 1001")]
    fn a_window_past_the_bound_is_a_bug_of_the_caller() {
        let _ = PollWindow::new(MAX_POLL_US + 1);
    }
}
