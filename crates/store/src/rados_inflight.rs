//! The operations of a RADOS pool handle that are under way, so that a node releasing its
//! lease can first stop new ones and then wait for the last to end.
//!
//! Why: a clean release unlocks the lease, and the next node then takes it at once and
//! fences nobody (lease.rs). An operation still under way at that moment (a request's write,
//! an asynchronous write whose completion has not come back, a metadata commit) would land
//! after the successor started serving, and could overwrite what the successor acknowledged.
//! So the release refuses every new operation first (`Pool::stop_io`), then waits here until
//! none is left, and only then unlocks; an operation that cannot end leaves the lease to
//! expire, and the successor fences this node (lease.rs, `Lease::release`).
//!
//! Every operation is counted from *before* it checks whether the pool still takes I/O to
//! its end (for an asynchronous one, its completion callback): with the count raised before
//! the check and the stop set before the count is read (both sequentially consistent), an
//! operation either sees the stop and never starts, or is seen by the drain.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The count of operations under way, and who waits for it to reach zero.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    ops: AtomicUsize,
    lock: Mutex<()>,
    drained: Condvar,
}

/// One operation under way; ends it when dropped.
#[derive(Debug)]
pub(crate) struct OpGuard(Arc<InFlight>);

impl Drop for OpGuard {
    fn drop(&mut self) {
        if self.0.ops.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Under the lock, so a drain between its check and its wait cannot miss this.
            let _held = self.0.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.0.drained.notify_all();
        }
    }
}

impl InFlight {
    /// Counts one operation as under way (the caller checks afterwards whether it may run).
    pub(crate) fn begin(self: &Arc<Self>) -> OpGuard {
        self.ops.fetch_add(1, Ordering::SeqCst);
        OpGuard(Arc::clone(self))
    }

    /// Operations under way now.
    pub(crate) fn count(&self) -> usize {
        self.ops.load(Ordering::SeqCst)
    }

    /// Waits until no operation is under way, at most `timeout`; whether none is.
    pub(crate) fn wait_drained(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.count() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            held = self
                .drained
                .wait_timeout(held, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_waits_for_the_last_operation_and_times_out_while_one_is_left() {
        let inflight = Arc::new(InFlight::default());
        assert!(inflight.wait_drained(Duration::ZERO), "nothing under way");
        let first = inflight.begin();
        let second = inflight.begin();
        assert_eq!(inflight.count(), 2);
        assert!(!inflight.wait_drained(Duration::from_millis(1)));
        drop(first);
        assert!(!inflight.wait_drained(Duration::from_millis(1)));
        let waiter = {
            let inflight = Arc::clone(&inflight);
            std::thread::spawn(move || inflight.wait_drained(Duration::from_secs(60)))
        };
        drop(second);
        assert!(
            waiter.join().unwrap(),
            "the drain ended when the last op did"
        );
        assert_eq!(inflight.count(), 0);
    }
}
