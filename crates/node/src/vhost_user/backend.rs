//! The vhost-user-blk device one frontend connection talks to: what it offers (features,
//! protocol features, queues, the config space) and what it does when a queue is kicked
//! (pop each available chain, parse it, hand it to its queue's submitter).
//!
//! Why the event thread only parses: rust-vmm's framework calls `handle_event` on its own
//! thread for every kick, and that thread must not wait (for a request slot, for budget, for
//! a scheduler decision), or every queue it serves stops. So it reads each chain into a
//! request (`vhost_user::request`, bounded and checked), counts it in flight and passes it
//! on; the pipeline's waiting happens in the queue's tasks (`vhost_user::queue`). The
//! protocol itself (SET_MEM_TABLE, ADD/REM_MEM_REG, the vring addresses, kick and call fds)
//! is the framework's: memory it maps is replaced under `GuestMemoryAtomic`, and a request
//! in flight keeps the mapping it was read against.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use headroom_store::Volume;
use tokio::sync::{mpsc, oneshot};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringT};
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use super::poll::PollWindow;
use super::queue::{self, Arrived, Mem, QueueContext, QueueEnded, Vring};
use super::queue_state::{QueueCounters, QueueState};
use super::request::parse;
use super::used_order::UsedOrder;
use super::watchdog::{self, Seen, Stuck};
use super::wire::{BlkConfig, ID_BYTES, features};
use crate::net_threads::NetThreads;
use crate::pipeline::Pipeline;
use crate::sync::lock;

/// Descriptors per queue the driver may set up at most.
pub const MAX_QUEUE_SIZE: usize = 256;
/// How long `GET_VRING_BASE` waits for the queue's requests in flight.
const STOP_WAIT: Duration = Duration::from_secs(30);
/// Largest DISCARD or WRITE_ZEROES one request may name (the pipeline cuts it into pieces).
pub const MAX_RANGE_BYTES: u32 = 1 << 30;

/// One queue's way to its tasks.
#[derive(Debug)]
struct QueueLink {
    arrivals: mpsc::UnboundedSender<Arrived>,
    order: Arc<UsedOrder>,
    counters: Arc<QueueCounters>,
    /// What the watchdog saw at its previous look.
    seen: Mutex<Seen>,
    /// Whether this connection has drained the queue before: the first drain says where the
    /// ring stood (a frontend reconnecting after a crash hands over a ring already in use).
    drained_before: AtomicBool,
    /// How long the event thread keeps looking at the ring after draining it.
    poll: PollWindow,
    /// Stops the queue's tasks ([`BlkBackend::close`]), and what says they have ended.
    close: Mutex<Option<(oneshot::Sender<()>, QueueEnded)>>,
}

/// What a device offers beyond its volume.
#[derive(Clone, Copy, Debug)]
pub struct DeviceOptions {
    pub num_queues: u16,
    /// The adaptive polling window's maximum, µs (0: event mode; `vhost_user::poll`).
    pub poll_us: u32,
}

/// The device behind one frontend connection.
#[derive(Debug)]
pub(super) struct BlkBackend {
    queues: Vec<QueueLink>,
    config: [u8; super::wire::CONFIG_BYTES],
    read_only: bool,
    max_data_bytes: u32,
    event_idx: AtomicBool,
    mem: Mutex<Option<Mem>>,
}

impl BlkBackend {
    /// A device of `volume` with `options.num_queues` queues, each with its tasks on one of
    /// `threads` (spread as connections are) or, without them, on the node's runtime.
    pub(super) fn new(
        pipeline: &Arc<Pipeline>,
        volume: &Arc<Volume>,
        options: DeviceOptions,
        threads: Option<&Arc<NetThreads>>,
    ) -> Self {
        let DeviceOptions {
            num_queues,
            poll_us,
        } = options;
        let mut id = [0u8; ID_BYTES];
        let name = volume.name().as_bytes();
        let cut = name.len().min(ID_BYTES);
        id[..cut].copy_from_slice(&name[..cut]);
        let queues = (0..num_queues)
            .map(|_| {
                let (arrivals, receiver) = mpsc::unbounded_channel();
                let order = Arc::new(UsedOrder::default());
                let counters = Arc::new(QueueCounters::default());
                let (close, closed) = oneshot::channel();
                let tasks = queue::start(
                    QueueContext {
                        pipeline: Arc::clone(pipeline),
                        volume: Arc::clone(volume),
                        order: Arc::clone(&order),
                        counters: Arc::clone(&counters),
                        id,
                    },
                    receiver,
                    closed,
                    threads,
                );
                QueueLink {
                    arrivals,
                    order,
                    counters,
                    seen: Mutex::new(Seen::default()),
                    drained_before: AtomicBool::new(false),
                    poll: PollWindow::new(poll_us),
                    close: Mutex::new(Some((close, tasks))),
                }
            })
            .collect();
        let config = BlkConfig {
            capacity_bytes: volume.size_bytes(),
            num_queues,
            max_discard_bytes: MAX_RANGE_BYTES,
        }
        .encode();
        BlkBackend {
            queues,
            config,
            read_only: volume.read_only(),
            max_data_bytes: pipeline.limits.max_request_bytes,
            event_idx: AtomicBool::new(false),
            mem: Mutex::new(None),
        }
    }

    /// Stops every queue's tasks once the frontend is gone: they take nothing more, deliver
    /// the replies of what they submitted and end; what to wait for (from the accepting
    /// thread).
    pub(super) fn close(&self) -> Vec<QueueEnded> {
        self.queues
            .iter()
            .filter_map(|link| lock(&link.close).take())
            .map(|(close, tasks)| {
                let _ = close.send(());
                tasks
            })
            .collect()
    }

    /// Every queue's state now (`vhost_user::queue_state`).
    pub(super) fn queue_states(&self) -> Vec<QueueState> {
        let mem = lock(&self.mem).clone();
        self.queues
            .iter()
            .zip(0u16..)
            .map(|(link, index)| link.counters.state(index, &link.order, mem.as_ref()))
            .collect()
    }

    /// Serves a queue that was kicked (or found stuck by the watchdog): drains it, polls it
    /// for a while if the attachment says so, and asks for kicks again.
    fn serve_queue(&self, link: &QueueLink, vring: &Vring, mem: &Mem) {
        let polling = link.poll.window_ns() > 0;
        if !self.event_idx.load(Ordering::Acquire) && !polling {
            self.drain(link, vring, mem);
            return;
        }
        // No kicks while draining (and while polling), then look once more after re-enabling
        // them, so a chain made available in between is not left waiting for a kick that
        // will not come.
        loop {
            let _ = vring.disable_notification();
            self.drain(link, vring, mem);
            if link.poll.spin(|| has_chains(vring, mem)) {
                continue;
            }
            match vring.enable_notification() {
                Ok(true) => continue,
                _ => break,
            }
        }
    }

    /// One look of the watchdog at every queue being served (`vhost_user::watchdog`): a
    /// queue stuck since the previous look is moved on. What it found, by queue.
    pub(super) fn watch(&self) -> Vec<(u16, Stuck)> {
        let Some(mem) = lock(&self.mem).clone() else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for (link, index) in self.queues.iter().zip(0u16..) {
            let Some(vring) = link.counters.vring() else {
                continue;
            };
            let Some(now) = watchdog::look(vring, &mem) else {
                *lock(&link.seen) = Seen::default();
                continue;
            };
            let (stuck, seen) = {
                let mut before = lock(&link.seen);
                let (stuck, seen) = watchdog::judge(now, *before);
                *before = seen;
                (stuck, seen)
            };
            if stuck.pop {
                link.counters.watchdog_popped();
                self.serve_queue(link, vring, &mem);
            }
            if stuck.signal {
                link.counters.resignal(vring);
            }
            if stuck.pop || stuck.signal {
                tracing::debug!("vhost-user-blk: queue {index} stuck: {now:?}, {seen:?}");
                found.push((index, stuck));
            }
        }
        found
    }

    /// Pops every available chain of `vring` and passes it on.
    fn drain(&self, link: &QueueLink, vring: &Vring, mem: &Mem) {
        let memory = mem.memory();
        let mut state = vring.get_mut();
        // A ring the frontend disabled is not touched (the watchdog may look just before).
        if !state.is_enabled() {
            return;
        }
        let queue = state.get_queue_mut();
        if !link.drained_before.swap(true, Ordering::AcqRel) {
            let next_avail = queue.next_avail();
            let avail = queue
                .avail_idx(&*memory, Ordering::Acquire)
                .ok()
                .map(|i| i.0);
            let used = queue
                .used_idx(&*memory, Ordering::Acquire)
                .ok()
                .map(|i| i.0);
            if next_avail != 0 || used.is_some_and(|used| used != 0) {
                tracing::info!(
                    "vhost-user-blk: a queue resumes at available index {next_avail} \
                     (the driver's: {avail:?}, used: {used:?}): {} chains taken again",
                    avail.map_or(0, |avail| avail.wrapping_sub(next_avail))
                );
            }
        }
        while let Some(chain) = queue.pop_descriptor_chain(memory.clone()) {
            let head = chain.head_index();
            let parsed = parse(head, chain, &*memory, self.max_data_bytes, MAX_RANGE_BYTES);
            let seq = link.order.popped();
            let arrived = Arrived {
                parsed,
                seq,
                mem: memory.clone(),
                vring: vring.clone(),
            };
            if let Err(mpsc::error::SendError(arrived)) = link.arrivals.send(arrived) {
                // The queue's tasks are gone (the node is stopping): nothing will answer it.
                tracing::debug!("vhost-user-blk: a chain arrived after its queue stopped");
                drop(arrived);
            }
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.queues.len()
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        features(self.read_only)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Release);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let start = offset as usize;
        let end = start.saturating_add(size as usize);
        self.config
            .get(start..end)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *lock(&self.mem) = Some(mem);
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if let Some(link) = self.queues.get(queue_index as usize)
            && !link.order.wait_drained(STOP_WAIT)
        {
            tracing::warn!(
                "vhost-user-blk: queue {queue_index} stopped with requests still in flight"
            );
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Ok(());
        }
        let index = usize::from(device_event);
        let (Some(link), Some(vring)) = (self.queues.get(index), vrings.get(index)) else {
            return Ok(());
        };
        link.counters.kicked(vring);
        let Some(mem) = lock(&self.mem).clone() else {
            return Ok(());
        };
        self.serve_queue(link, vring, &mem);
        Ok(())
    }
}

/// Whether the driver has made chains available that are not popped yet.
fn has_chains(vring: &Vring, mem: &Mem) -> bool {
    let memory = mem.memory();
    let state = vring.get_ref();
    let queue = state.get_queue();
    queue
        .avail_idx(&*memory, Ordering::Acquire)
        .is_ok_and(|avail| avail.0 != queue.next_avail())
}
