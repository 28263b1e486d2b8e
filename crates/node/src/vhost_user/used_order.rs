//! One virtqueue's chains returned used in the order they were popped, whatever order the
//! pipeline finishes them in.
//!
//! Why in order: it is what makes a crash of the node safe for the guest. When the backend
//! dies, the frontend cannot ask it where the ring stood (`GET_VRING_BASE` fails), so QEMU
//! restarts the ring at the used index it finds in guest memory (it resets its last
//! available index to the used index), and the next backend pops every chain from there.
//! That is right only if the chains before the used index are exactly the ones answered: out
//! of order, a chain popped early and still unanswered at the crash would sit below the used
//! index and never be popped again (the guest waits for it forever), and one answered late
//! would be run twice. The vhost-user protocol's other answer, the inflight shared memory
//! (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`), needs the message handler's cooperation, which
//! rust-vmm's `vhost-user-backend` 0.24 refuses (docs/ARCHITECTURE.md, decision 69).
//!
//! What in order costs: a chain finished early waits for the ones popped before it (a read
//! behind a slow write on the same queue). Each queue is a stream of one vCPU's requests
//! meeting the same per-volume scheduler, so they mostly finish in order anyway.
//!
//! A chain counts as in flight from its pop to its return, so `GET_VRING_BASE` (the frontend
//! stopping the queue) can wait until every chain the guest handed over is answered.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use vhost_user_backend::VringT;

use super::queue::Vring;
use crate::sync::lock;

/// A chain finished before one popped earlier: returned once those are.
#[derive(Clone, Copy, Debug)]
struct Held {
    head: u16,
    written_bytes: u32,
}

#[derive(Debug, Default)]
struct Returned {
    /// The sequence number of the next chain to return used.
    next: u64,
    /// Chains `next`, `next + 1`, ...: `Some` once finished.
    held: VecDeque<Option<Held>>,
}

/// The pop order of one queue's chains and the returns that follow it.
#[derive(Debug, Default)]
pub(super) struct UsedOrder {
    /// Sequence numbers handed out (pops, in ring order: the event thread pops under the
    /// vring's lock).
    popped: AtomicU64,
    returned: Mutex<Returned>,
    drained: Condvar,
}

impl UsedOrder {
    /// The sequence number of a chain just popped.
    pub(super) fn popped(&self) -> u64 {
        self.popped.fetch_add(1, Ordering::AcqRel)
    }

    /// Chain `seq` is answered (its data and status are in guest memory): returns it used,
    /// and every chain after it already answered, in pop order. Whether any chain was
    /// returned (the driver may then need a signal).
    pub(super) fn finish(&self, vring: &Vring, seq: u64, head: u16, written_bytes: u32) -> bool {
        let mut returned = lock(&self.returned);
        assert!(
            seq >= returned.next && seq < self.popped.load(Ordering::Acquire),
            "chain {seq} finished twice or never popped (next to return: {})",
            returned.next
        );
        let at = usize::try_from(seq - returned.next).expect("a queue's chains fit in memory");
        if returned.held.len() <= at {
            returned.held.resize(at + 1, None);
        }
        returned.held[at] = Some(Held {
            head,
            written_bytes,
        });
        let mut any = false;
        while let Some(Some(ready)) = returned.held.front().copied() {
            returned.held.pop_front();
            returned.next += 1;
            // Under the order's lock, so two finishers cannot return chains out of order.
            if let Err(err) = vring.add_used(ready.head, ready.written_bytes) {
                tracing::warn!("vhost-user-blk: returning descriptor {}: {err}", ready.head);
            }
            any = true;
        }
        if returned.next == self.popped.load(Ordering::Acquire) {
            self.drained.notify_all();
        }
        any
    }

    /// Chains popped and chains returned used so far.
    pub(super) fn counts(&self) -> (u64, u64) {
        let returned = lock(&self.returned).next;
        (self.popped.load(Ordering::Acquire), returned)
    }

    /// Waits until every popped chain is returned, at most `limit`; whether they all were.
    pub(super) fn wait_drained(&self, limit: Duration) -> bool {
        let returned = lock(&self.returned);
        let (returned, _) = self
            .drained
            .wait_timeout_while(returned, limit, |r| {
                r.next < self.popped.load(Ordering::Acquire)
            })
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        returned.next == self.popped.load(Ordering::Acquire)
    }
}
