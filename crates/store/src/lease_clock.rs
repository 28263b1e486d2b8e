//! The clock a RADOS lease is aged on, and the moment the lease runs out on it.
//!
//! Why a clock of its own: the lock expires on the OSDs' clocks, which keep running while
//! this node's machine (or VM) is suspended. `CLOCK_MONOTONIC`, Rust's `Instant`, stops
//! then, so a node resumed after a suspend longer than its lease would go on serving a lease
//! another node may have taken. `CLOCK_BOOTTIME` counts the suspended time. A function, so
//! tests can make it jump.
//!
//! Why an expiry the pool checks: the watchdog looks only every eighth of a lease, so right
//! after a resume it may not have looked yet. Every operation of the store's pool handle
//! compares the clock with the end of the lease as of the last renewal (one clock read; an
//! operation is a network round trip), so none is sent once the lease may have run out,
//! whoever notices first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Time since some fixed point, suspended time included.
pub(crate) type LeaseClock = Arc<dyn Fn() -> Duration + Send + Sync>;

/// [`LeaseClock`] on the kernel's `CLOCK_BOOTTIME`.
pub(crate) fn boot_clock() -> LeaseClock {
    Arc::new(|| {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0),
        )
    })
}

/// When a held lease runs out, on its clock: the last successful renewal's send time plus
/// the lease's duration (renewals move it on).
pub(crate) struct LeaseExpiry {
    clock: LeaseClock,
    until_ns: AtomicU64,
}

impl std::fmt::Debug for LeaseExpiry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseExpiry")
            .field("until_ns", &self.until_ns.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

fn as_ns(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}

impl LeaseExpiry {
    /// A lease renewed at `renewed` (on `clock`) for `duration`.
    pub(crate) fn new(clock: LeaseClock, renewed: Duration, duration: Duration) -> LeaseExpiry {
        LeaseExpiry {
            clock,
            until_ns: AtomicU64::new(as_ns(renewed.saturating_add(duration))),
        }
    }

    /// A renewal sent at `renewed` succeeded: the lease runs until `renewed + duration`.
    pub(crate) fn renewed(&self, renewed: Duration, duration: Duration) {
        self.until_ns
            .fetch_max(as_ns(renewed.saturating_add(duration)), Ordering::SeqCst);
    }

    /// Whether the lease may have run out by now.
    pub(crate) fn expired(&self) -> bool {
        as_ns((self.clock)()) >= self.until_ns.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expires_a_duration_after_its_last_renewal_on_its_clock() {
        let now_ns = Arc::new(AtomicU64::new(1_000));
        let clock: LeaseClock = {
            let now_ns = Arc::clone(&now_ns);
            Arc::new(move || Duration::from_nanos(now_ns.load(Ordering::SeqCst)))
        };
        let expiry = LeaseExpiry::new(
            clock,
            Duration::from_nanos(1_000),
            Duration::from_nanos(500),
        );
        assert!(!expiry.expired());
        now_ns.store(1_499, Ordering::SeqCst);
        assert!(!expiry.expired());
        now_ns.store(1_500, Ordering::SeqCst);
        assert!(expiry.expired(), "a whole duration after the renewal");
        expiry.renewed(Duration::from_nanos(1_400), Duration::from_nanos(500));
        assert!(!expiry.expired(), "renewed until 1,900");
        // A renewal that was sent earlier but answered later never moves the end back.
        expiry.renewed(Duration::from_nanos(1_000), Duration::from_nanos(500));
        assert!(!expiry.expired());
        now_ns.store(1_900, Ordering::SeqCst);
        assert!(expiry.expired());
    }

    #[test]
    fn the_boot_clock_moves_forward() {
        let clock = boot_clock();
        let (a, b) = (clock(), clock());
        assert!(a > Duration::ZERO && b >= a);
    }
}
