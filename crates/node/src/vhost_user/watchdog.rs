//! A connection's watchdog: every [`WATCH_PERIOD`] it looks at each queue's ring in guest
//! memory, and a queue found stuck the same way twice in a row is moved on: chains the driver
//! made available and nobody popped are popped (a kick that never reached the backend), and
//! used chains the driver asked to be interrupted for and has not taken get their interrupt
//! again (a signal that never reached the driver). Each is counted with the queue
//! (`vhost_user::queue_state`) and logged as a warning the first time on a connection.
//!
//! Why a watchdog and not only the event path: the event path has single points that fail
//! silently. rust-vmm's `vhost-user-backend` 0.24 runs every queue of a connection on one
//! worker thread, and an error reading a kick eventfd ends that thread with nothing logged
//! and nothing told: every queue of the device then stops for good while the protocol
//! socket still answers. A signal written to a call eventfd the frontend swapped out (a
//! masked MSI-X vector) waits in the old one. A guest whose disk stops answering is the
//! worst thing a block device can do (the guest's I/O hangs until it is rebooted), and one
//! look at a few words of guest memory ten times a second costs nothing beside a request.
//! It runs on the node's runtime, not on the framework's worker, so it keeps a queue moving
//! (slowly, a period per round) even when that worker is gone. What it cannot tell from
//! guest memory, it leaves alone: without EVENT_IDX a driver does not say which used chains
//! it has taken, so only lost kicks are looked for then. Decision 71 in
//! `docs/ARCHITECTURE.md` says why it is there beside finding each cause.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace};

use super::backend::BlkBackend;
use super::queue::{Mem, Vring};

/// How often each queue is looked at; a queue stuck across two looks is moved on.
pub(super) const WATCH_PERIOD: Duration = Duration::from_millis(100);

/// Bytes before the available ring's entries (`flags`, `idx`) and per entry; `used_event`
/// follows the entries.
const AVAIL_HEADER_BYTES: u64 = 4;
const AVAIL_ENTRY_BYTES: u64 = 2;

/// What one queue looked like at the previous look.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// The backend's next available index while the driver's was ahead of it.
    unpopped: Option<u16>,
    /// The used index and the driver's `used_event` while the driver had used chains it
    /// asked to be interrupted for.
    unsignalled: Option<(u16, u16)>,
    /// Whether the interrupt for `unsignalled` was sent again already: once is what a lost
    /// one needs; a driver that stays there after it has its reasons (it polls, or it is
    /// not running), and is not interrupted ten times a second for them.
    resignalled: bool,
}

/// What a look found to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Stuck {
    pub(super) pop: bool,
    pub(super) signal: bool,
}

/// The ring words a look reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RingNow {
    pub(super) driver_avail: u16,
    pub(super) next_avail: u16,
    pub(super) used: u16,
    /// The driver's `used_event` (EVENT_IDX only).
    pub(super) used_event: Option<u16>,
    pub(super) size: u16,
}

/// Compares a look with the one before: what is stuck, and what to remember.
pub(super) fn judge(now: RingNow, before: Seen) -> (Stuck, Seen) {
    let unpopped = (now.driver_avail != now.next_avail).then_some(now.next_avail);
    // The driver asked for an interrupt once the used index passes `used_event`, and it has:
    // between 1 and a ring's worth of entries past it (Linux writes 0 there while its
    // callbacks are off, which this range leaves out once the index has wrapped past it).
    let unsignalled = now.used_event.and_then(|used_event| {
        let past = now.used.wrapping_sub(used_event);
        (past >= 1 && past <= now.size).then_some((now.used, used_event))
    });
    let same_unsignalled = unsignalled.is_some() && unsignalled == before.unsignalled;
    let stuck = Stuck {
        pop: unpopped.is_some() && unpopped == before.unpopped,
        signal: same_unsignalled && !before.resignalled,
    };
    (
        stuck,
        Seen {
            unpopped,
            unsignalled,
            resignalled: same_unsignalled,
        },
    )
}

/// Reads the ring words of `vring` in `mem`; `None` while the queue is not being served
/// (not set up, not enabled, or stopped).
pub(super) fn look(vring: &Vring, mem: &Mem) -> Option<RingNow> {
    let state = vring.get_ref();
    let queue = state.get_queue();
    if !queue.ready() || !state.is_enabled() {
        return None;
    }
    let memory = mem.memory();
    let driver_avail = queue.avail_idx(&*memory, Ordering::Acquire).ok()?.0;
    let used = queue.used_idx(&*memory, Ordering::Acquire).ok()?.0;
    let used_event = if queue.event_idx_enabled() {
        let at =
            queue.avail_ring() + AVAIL_HEADER_BYTES + u64::from(queue.size()) * AVAIL_ENTRY_BYTES;
        Some(
            memory
                .load::<u16>(GuestAddress(at), Ordering::Acquire)
                .ok()?,
        )
    } else {
        None
    };
    Some(RingNow {
        driver_avail,
        next_avail: queue.next_avail(),
        used,
        used_event,
        size: queue.size(),
    })
}

/// What the watchdogs of an attachment's connections did, all of them together.
#[derive(Debug, Default)]
pub(super) struct WatchdogTotals {
    pub(super) pops: AtomicU64,
    pub(super) signals: AtomicU64,
}

/// Looks at `backend`'s queues every [`WATCH_PERIOD`] until `stop` fires (or its sender is
/// dropped), adding what it does to `totals`.
pub(super) async fn run(
    backend: Arc<BlkBackend>,
    totals: Arc<WatchdogTotals>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut every = tokio::time::interval(WATCH_PERIOD);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let warned_pop = AtomicBool::new(false);
    let warned_signal = AtomicBool::new(false);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => return,
            _ = every.tick() => {}
        }
        for (index, stuck) in backend.watch() {
            if stuck.pop {
                totals.pops.fetch_add(1, Ordering::Relaxed);
                warn_once(
                    &warned_pop,
                    index,
                    "chains the driver made available were not popped for a whole watch \
                     period (a kick lost, or the framework's worker gone); popped them",
                );
            }
            if stuck.signal {
                totals.signals.fetch_add(1, Ordering::Relaxed);
                warn_once(
                    &warned_signal,
                    index,
                    "used chains the driver asked to be interrupted for were not taken for \
                     a whole watch period (an interrupt lost); signalled again",
                );
            }
        }
    }
}

fn warn_once(warned: &AtomicBool, queue: u16, what: &str) {
    if warned.swap(true, Ordering::Relaxed) {
        tracing::debug!("vhost-user-blk: queue {queue}: {what}");
    } else {
        tracing::warn!("vhost-user-blk: queue {queue}: {what} (said once per connection)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(driver_avail: u16, next_avail: u16, used: u16, used_event: Option<u16>) -> RingNow {
        RingNow {
            driver_avail,
            next_avail,
            used,
            used_event,
            size: 128,
        }
    }

    #[test]
    fn a_queue_is_stuck_only_when_it_looks_the_same_twice() {
        // Chains not popped: remembered at the first look, stuck at the second.
        let (stuck, seen) = judge(ring(5, 3, 3, Some(2)), Seen::default());
        assert_eq!(stuck, Stuck::default());
        let (stuck, _) = judge(ring(6, 3, 3, Some(2)), seen);
        assert!(stuck.pop && stuck.signal, "{stuck:?}");
        // The backend moved on in between: not stuck.
        let (stuck, _) = judge(ring(6, 4, 3, Some(2)), seen);
        assert!(!stuck.pop);
        // Signalled again once; still there at the next look, it is left alone.
        let (_, again) = judge(ring(6, 3, 3, Some(2)), seen);
        let (stuck, again) = judge(ring(6, 3, 3, Some(2)), again);
        assert!(stuck.pop && !stuck.signal, "{stuck:?}");
        let (stuck, _) = judge(ring(6, 3, 4, Some(2)), again);
        assert!(
            !stuck.signal,
            "a new used index is a new state, looked at twice first"
        );
        // The driver took the used chains and asks for the next one: nothing to signal.
        let (stuck, seen) = judge(ring(3, 3, 3, Some(3)), seen);
        assert_eq!(stuck, Stuck::default());
        assert_eq!(seen, Seen::default());
    }

    #[test]
    fn an_interrupt_is_owed_only_past_used_event_and_within_a_ring() {
        let owed = |used: u16, used_event: u16| {
            let (_, seen) = judge(ring(used, used, used, Some(used_event)), Seen::default());
            seen.unsignalled.is_some()
        };
        assert!(owed(10, 9), "one past: the driver waits for it");
        assert!(!owed(10, 10), "nothing past used_event");
        assert!(!owed(10, 12), "the driver asked to be told later");
        assert!(owed(3, 65_535), "across the wrap");
        assert!(
            !owed(1_000, 0),
            "Linux's 0 while its callbacks are off, far behind"
        );
        // Without EVENT_IDX nothing says what the driver has taken.
        let (_, seen) = judge(ring(4, 4, 4, None), Seen::default());
        assert_eq!(seen.unsignalled, None);
    }
}
