//! The node's one monotonic clock, in nanoseconds since the node started.
//!
//! The QoS core takes time as an argument (`now_ns: u64`) and never reads a clock; this is the
//! clock the server passes in. Every part of the node that talks to the scheduler (sessions,
//! the pacing timer, the emulated device's completion thread) reads the same `Clock`, so their
//! times compare.

use std::time::{Duration, Instant};

/// A monotonic clock with a fixed origin.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

impl Clock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        Clock {
            origin: Instant::now(),
        }
    }

    /// Nanoseconds since the origin (saturates after 584 years).
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant at `ns` on this clock.
    pub fn instant_at(&self, ns: u64) -> Instant {
        self.origin + Duration::from_nanos(ns)
    }

    /// Time from now until `ns` (zero if it has passed).
    pub fn until(&self, ns: u64) -> Duration {
        Duration::from_nanos(ns.saturating_sub(self.now_ns()))
    }
}

/// Makes the calling thread's timed waits wake as close to their deadline as the kernel can.
///
/// Linux delays a sleeping thread's wake-up by up to its "timer slack" (50 µs by default) to
/// batch wake-ups. For the threads that release paced requests and deliver the emulated
/// device's completions, 50 µs late on every wake-up is capacity and latency lost; 1 ns of
/// slack costs nothing measurable for two threads. Best effort: a failure is only logged.
pub fn wake_on_time() {
    if let Err(err) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1)) {
        tracing::debug!("could not lower the timer slack: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_moves_forward_and_instants_round_trip() {
        let clock = Clock::new();
        let a = clock.now_ns();
        let b = clock.now_ns();
        assert!(b >= a);
        let at = clock.instant_at(a + 1_000_000);
        assert!(at > clock.instant_at(a));
        assert_eq!(clock.until(0), Duration::ZERO);
    }
}
