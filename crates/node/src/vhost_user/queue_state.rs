//! What an attachment's virtqueues are doing right now, as the operator reads it in
//! `GET /v1/volumes/{name}/attachments`: where each ring stands in guest memory and in the
//! backend, how many chains are in flight, how many kicks came and how many signals went.
//!
//! Why it is shown: a guest whose disk stops answering looks the same from outside whatever
//! the cause (a kick never seen, a chain popped and never answered, an answer never
//! signalled, a signal sent with no call eventfd to carry it). These numbers tell them apart
//! without a debugger: the driver's available index ahead of the backend's next one is a
//! kick not acted on; popped ahead of returned is a request still in the pipeline; the used
//! index at the available one with the guest still waiting is a lost interrupt. The
//! counters are per connection (a reconnecting frontend starts them again), read without
//! stopping the queue (relaxed atomics, the vring's read lock for an instant).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;

use super::queue::{Mem, Vring};
use super::used_order::UsedOrder;

/// Kicks and signals of one queue on one connection.
#[derive(Default)]
pub(super) struct QueueCounters {
    kicks: AtomicU64,
    signals: AtomicU64,
    signals_skipped: AtomicU64,
    signals_without_call: AtomicU64,
    watchdog_pops: AtomicU64,
    watchdog_signals: AtomicU64,
    /// The queue's vring, known once the framework first hands it over (its first event).
    vring: OnceLock<Vring>,
}

/// `VringRwLock` has no `Debug`.
impl std::fmt::Debug for QueueCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueCounters")
            .field("kicks", &self.kicks)
            .field("signals", &self.signals)
            .finish_non_exhaustive()
    }
}

impl QueueCounters {
    /// A kick (or the framework's first look at a queue it starts serving) on `vring`.
    pub(super) fn kicked(&self, vring: &Vring) {
        self.kicks.fetch_add(1, Ordering::Relaxed);
        if self.vring.get().is_none() {
            let _ = self.vring.set(vring.clone());
        }
    }

    /// The queue's vring, once the framework handed it over.
    pub(super) fn vring(&self) -> Option<&Vring> {
        self.vring.get()
    }

    /// The watchdog found chains nobody popped (`vhost_user::watchdog`).
    pub(super) fn watchdog_popped(&self) {
        self.watchdog_pops.fetch_add(1, Ordering::Relaxed);
    }

    /// The watchdog found used chains the driver was never told of: signals again.
    pub(super) fn resignal(&self, vring: &Vring) {
        self.watchdog_signals.fetch_add(1, Ordering::Relaxed);
        if let Err(err) = vring.signal_used_queue() {
            tracing::warn!("vhost-user-blk: signalling the driver again: {err}");
        }
    }

    /// Signals the driver that chains are used if it asked to be (EVENT_IDX) or always
    /// without it, and counts what happened.
    pub(super) fn notify(&self, vring: &Vring) {
        if !vring.needs_notification().unwrap_or(true) {
            self.signals_skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if vring.get_ref().get_call().is_none() {
            // The framework's signal is then a silent no-op: say so where it can be seen.
            self.signals_without_call.fetch_add(1, Ordering::Relaxed);
        }
        match vring.signal_used_queue() {
            Ok(()) => {
                self.signals.fetch_add(1, Ordering::Relaxed);
            }
            Err(err) => tracing::warn!("vhost-user-blk: signalling the driver: {err}"),
        }
    }

    /// The queue's state now; `mem` is the guest memory the backend maps (`None` before the
    /// frontend sent it).
    pub(super) fn state(&self, index: u16, order: &UsedOrder, mem: Option<&Mem>) -> QueueState {
        let (popped_total, returned_total) = order.counts();
        let mut state = QueueState {
            index,
            serving: false,
            ready: false,
            enabled: false,
            event_idx: false,
            has_call_fd: false,
            next_avail: None,
            next_used: None,
            driver_avail_idx: None,
            used_idx: None,
            popped_total,
            returned_total,
            in_flight: popped_total.saturating_sub(returned_total),
            kicks_total: self.kicks.load(Ordering::Relaxed),
            signals_total: self.signals.load(Ordering::Relaxed),
            signals_skipped_total: self.signals_skipped.load(Ordering::Relaxed),
            signals_without_call_total: self.signals_without_call.load(Ordering::Relaxed),
            watchdog_pops_total: self.watchdog_pops.load(Ordering::Relaxed),
            watchdog_signals_total: self.watchdog_signals.load(Ordering::Relaxed),
        };
        let Some(vring) = self.vring.get() else {
            return state;
        };
        let ring = vring.get_ref();
        let queue = ring.get_queue();
        state.serving = true;
        state.ready = queue.ready();
        state.enabled = ring.is_enabled();
        state.event_idx = queue.event_idx_enabled();
        state.has_call_fd = ring.get_call().is_some();
        state.next_avail = Some(queue.next_avail());
        state.next_used = Some(queue.next_used());
        if let Some(mem) = mem
            && queue.ready()
        {
            let memory = mem.memory();
            state.driver_avail_idx = queue
                .avail_idx(&*memory, Ordering::Acquire)
                .ok()
                .map(|i| i.0);
            state.used_idx = queue
                .used_idx(&*memory, Ordering::Acquire)
                .ok()
                .map(|i| i.0);
        }
        state
    }
}

/// One virtqueue of a connected frontend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct QueueState {
    pub index: u16,
    /// Whether the backend has started serving it (the frontend set it up and it was kicked
    /// or looked at once); the fields below that need the ring are absent until then.
    pub serving: bool,
    /// Set up by the frontend (its kick eventfd given) and not stopped.
    pub ready: bool,
    /// Enabled by the frontend (`SET_VRING_ENABLE`).
    pub enabled: bool,
    /// The driver and device suppress kicks and interrupts by index (`VIRTIO_RING_F_EVENT_IDX`).
    pub event_idx: bool,
    /// Whether the backend has an eventfd to signal the driver with.
    pub has_call_fd: bool,
    /// The next available entry the backend will pop.
    pub next_avail: Option<u16>,
    /// The next used entry the backend will write.
    pub next_used: Option<u16>,
    /// The available index the driver published (guest memory).
    pub driver_avail_idx: Option<u16>,
    /// The used index the backend published (guest memory).
    pub used_idx: Option<u16>,
    /// Chains popped on this connection.
    pub popped_total: u64,
    /// Chains returned used on this connection.
    pub returned_total: u64,
    /// Chains popped and not yet returned.
    pub in_flight: u64,
    /// Events handled (kicks, and the first look at a queue being started).
    pub kicks_total: u64,
    /// Interrupts signalled to the driver.
    pub signals_total: u64,
    /// Returns after which the driver had not asked for an interrupt (EVENT_IDX).
    pub signals_skipped_total: u64,
    /// Signals due while the backend had no call eventfd (each one lost).
    pub signals_without_call_total: u64,
    /// Times the watchdog found chains nobody popped for a whole period and popped them
    /// (`vhost_user::watchdog`: a kick lost, or the framework's worker gone).
    pub watchdog_pops_total: u64,
    /// Times the watchdog found used chains the driver was never told of and signalled again.
    pub watchdog_signals_total: u64,
}

/// A vhost-user attachment's frontend, as it is now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct AttachmentState {
    /// Whether a frontend is connected.
    pub connected: bool,
    /// Frontends that connected since the attachment started (a reconnect counts again).
    pub connections_total: u64,
    /// Stuck queues the watchdog moved on by popping, over every connection
    /// (`vhost_user::watchdog`; each one is a kick lost or the framework's worker gone).
    pub watchdog_pops_total: u64,
    /// Interrupts the watchdog sent again, over every connection (each one a lost interrupt).
    pub watchdog_signals_total: u64,
    /// The connected frontend's queues (empty when none is).
    pub queues: Vec<QueueState>,
}
