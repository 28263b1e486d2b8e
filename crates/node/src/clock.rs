//! The node's one monotonic clock, in nanoseconds since the node started.
//!
//! The QoS core takes time as an argument (`now_ns: u64`) and never reads a clock; this is the
//! clock the server passes in. Every part of the node that talks to the scheduler (sessions,
//! the pacing timer, the emulated device's completion thread) reads the same `Clock`, so their
//! times compare.
//!
//! A clock can also be driven by hand ([`Clock::manual`]): a node started with one
//! (`Node::start_with_clock`) sees time move only when its test says so, so what the policies
//! decide from time (a rate's tokens, a credit's refill, a window's end) is exactly what the
//! test set up, on a loaded machine too. Only the node's view of time is manual: socket
//! timeouts and deadlines stay on the runtime's real timers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock with a fixed origin, or a manual one.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
    /// Set for a manual clock: the time is what it holds.
    manual: Option<&'static ManualTime>,
}

/// The time of a manual clock, moved forward by [`ManualTime::advance`].
#[derive(Debug, Default)]
pub struct ManualTime {
    now_ns: AtomicU64,
}

impl ManualTime {
    /// The manual clock's time, ns.
    pub fn now_ns(&self) -> u64 {
        self.now_ns.load(Ordering::Acquire)
    }

    /// Moves the time forward by `ns` (never back: a monotonic clock). The node's timed
    /// waits (the scheduler's wake-up thread, the emulated device) wake within the real time
    /// they were waiting for, and then see the new time.
    pub fn advance(&self, ns: u64) {
        self.now_ns.fetch_add(ns, Ordering::AcqRel);
    }
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
            manual: None,
        }
    }

    /// A clock at `start_ns` that moves only when the returned handle advances it. Its time
    /// lives as long as the process (a few bytes, leaked: the clock is `Copy` and shared by
    /// every part of a node, and tests start few of them).
    pub fn manual(start_ns: u64) -> (Clock, &'static ManualTime) {
        let time: &'static ManualTime = Box::leak(Box::new(ManualTime {
            now_ns: AtomicU64::new(start_ns),
        }));
        let clock = Clock {
            origin: Instant::now(),
            manual: Some(time),
        };
        (clock, time)
    }

    /// Nanoseconds since the origin (saturates after 584 years).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self.manual {
            None => u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Some(time) => time.now_ns(),
        }
    }

    /// The instant at `ns` on this clock (a manual clock: as far from now as `ns` is from its
    /// time).
    pub fn instant_at(&self, ns: u64) -> Instant {
        match self.manual {
            None => self.origin + Duration::from_nanos(ns),
            Some(time) => Instant::now() + Duration::from_nanos(ns.saturating_sub(time.now_ns())),
        }
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

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let (clock, time) = Clock::manual(5);
        assert_eq!(clock.now_ns(), 5);
        assert_eq!(clock.now_ns(), 5, "no time passes by itself");
        assert_eq!(clock.until(1_005), Duration::from_nanos(1_000));
        time.advance(1_000);
        assert_eq!((clock.now_ns(), time.now_ns()), (1_005, 1_005));
        assert_eq!(clock.until(1_005), Duration::ZERO);
        // Copies share the time.
        let copy = clock;
        time.advance(1);
        assert_eq!(copy.now_ns(), 1_006);
    }
}
