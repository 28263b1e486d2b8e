//! A vhost-user-blk client: a frontend that speaks the vhost-user protocol to a device's
//! socket (rust-vmm's `vhost` frontend), shares a memfd with it as the "guest" memory, and
//! drives its virtqueues as a virtio-blk driver would (`virtqueue`).
//!
//! Why in the lab: it is the second way to load a Headroom node after NBD (`NbdClient`), so
//! the node's tests use it to prove its vhost-user-blk door, and the vhost-user load
//! generator (`load`, `headroom lab vhost-load`) drives any vhost-user-blk backend with it.
//! Everything is blocking: the tests drive all queues from one thread through the client;
//! the load generator takes the queues out ([`VhostUserBlkClient::into_queues`], each a
//! [`QueueDriver`]) and drives each from a thread of its own over the one connection.

pub mod load;
pub mod pacing;
mod queue;
mod virtqueue;

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub use queue::{QueueDriver, Reaped};
pub use virtqueue::{Buffer, DriverQueue, RingLayout};

/// virtio-blk request types.
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
/// Status bytes.
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

const F_VERSION_1: u64 = 1 << 32;
const F_EVENT_IDX: u64 = 1 << 29;
const F_INDIRECT_DESC: u64 = 1 << 28;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// SEG_MAX, BLK_SIZE, FLUSH, MQ, DISCARD, WRITE_ZEROES, RO.
const F_BLK: u64 = (1 << 2) | (1 << 6) | (1 << 9) | (1 << 12) | (1 << 13) | (1 << 14) | (1 << 5);

/// Bytes of the shared memory set aside for the rings, from its start.
pub(crate) const RINGS_BYTES: u64 = 1 << 20;
/// How long [`VhostUserBlkClient::wait`] waits for a used chain before it calls the device
/// dead (a bound on a broken device, not a pace).
pub(crate) const ANSWER_TIMEOUT_MS: i32 = 30_000;

/// Why the client failed.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("vhost-user: {0}")]
    Frontend(#[from] vhost::Error),
    #[error("shared memory: {0}")]
    Memory(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the queue has no room for the request")]
    QueueFull,
    #[error("the device broke the protocol: {0}")]
    Protocol(&'static str),
    #[error("the device offers {0} queues; asked for more")]
    Queues(u64),
    #[error("no used chain within {ANSWER_TIMEOUT_MS} ms")]
    Timeout,
}

/// How the client sets up the device.
#[derive(Clone, Copy, Debug)]
pub struct ClientOptions {
    pub num_queues: u16,
    pub queue_size: u16,
    /// The shared memory (rings and buffers).
    pub mem_bytes: u64,
    /// Negotiate VIRTIO_RING_F_EVENT_IDX if the device offers it.
    pub event_idx: bool,
    /// Negotiate VIRTIO_RING_F_INDIRECT_DESC if the device offers it, and send every chain of
    /// more than one buffer through an indirect table.
    pub indirect: bool,
}

impl Default for ClientOptions {
    fn default() -> ClientOptions {
        ClientOptions {
            num_queues: 1,
            queue_size: 128,
            mem_bytes: 32 << 20,
            event_idx: true,
            indirect: false,
        }
    }
}

/// A virtio-blk request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlkOp {
    Read { offset: u64, len: u32 },
    Write { offset: u64, data: Vec<u8> },
    Flush,
    Discard { offset: u64, len: u32 },
    WriteZeroes { offset: u64, len: u32, unmap: bool },
    GetId,
}

/// A used chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkCompletion {
    pub head: u16,
    pub status: u8,
    /// READ's data or GET_ID's id (empty otherwise).
    pub data: Vec<u8>,
    /// What the device said it wrote (the used element's length).
    pub written_bytes: u32,
}

/// A chain built in a queue's buffers: its buffers, its status byte's address and where its
/// data is read back from once used.
type BuiltChain = (Vec<Buffer>, u64, Option<(u64, u32)>);

/// A connected, negotiated vhost-user-blk device.
pub struct VhostUserBlkClient {
    frontend: Frontend,
    mem: GuestMemoryMmap<()>,
    queues: Vec<QueueDriver>,
    config: Vec<u8>,
    acked_features: u64,
}

impl std::fmt::Debug for VhostUserBlkClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserBlkClient")
            .field("acked_features", &self.acked_features)
            .field("queues", &self.queues.len())
            .finish_non_exhaustive()
    }
}

pub(crate) fn mem_err(err: impl std::fmt::Display) -> VhostUserError {
    VhostUserError::Memory(err.to_string())
}

impl VhostUserBlkClient {
    /// Connects to `path` and sets the device up as QEMU would: owner, features, protocol
    /// features, config, the memory table (one memfd region), then each queue's size,
    /// addresses, base, call and kick fds, and enables it.
    pub fn connect(path: &Path, options: ClientOptions) -> Result<Self, VhostUserError> {
        let mut frontend = Frontend::connect(path, u64::from(options.num_queues))?;
        frontend.set_owner()?;
        let offered = frontend.get_features()?;
        let mut wanted = F_VERSION_1 | F_PROTOCOL_FEATURES | F_BLK;
        if options.event_idx {
            wanted |= F_EVENT_IDX;
        }
        if options.indirect {
            wanted |= F_INDIRECT_DESC;
        }
        let acked_features = offered & wanted;
        if acked_features & F_PROTOCOL_FEATURES != 0 {
            let protocol = frontend.get_protocol_features()?;
            let wanted = VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::REPLY_ACK;
            frontend.set_protocol_features(protocol & wanted)?;
            let queues = frontend.get_queue_num()?;
            if queues < u64::from(options.num_queues) {
                return Err(VhostUserError::Queues(queues));
            }
        }
        frontend.set_features(acked_features)?;
        let config = frontend
            .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
            .map(|(_, payload)| payload.to_vec())?;
        let mem = shared_memory(options.mem_bytes)?;
        let region = mem
            .iter()
            .next()
            .ok_or(VhostUserError::Protocol("no memory region"))?;
        let host_base = mem.get_host_address(GuestAddress(0)).map_err(mem_err)? as u64;
        let fd = region
            .file_offset()
            .ok_or(VhostUserError::Protocol("the memory is not file-backed"))?
            .file()
            .as_raw_fd();
        frontend.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: options.mem_bytes,
            userspace_addr: host_base,
            mmap_offset: 0,
            mmap_handle: fd,
        }])?;
        let arena_bytes = (options.mem_bytes - RINGS_BYTES) / u64::from(options.num_queues);
        let mut queues = Vec::new();
        let mut ring_base = 0u64;
        for q in 0..usize::from(options.num_queues) {
            let layout = RingLayout::at(ring_base, options.queue_size);
            ring_base += layout.span_bytes();
            if ring_base > RINGS_BYTES {
                return Err(VhostUserError::Memory(
                    "rings larger than their area".into(),
                ));
            }
            frontend.set_vring_num(q, options.queue_size)?;
            frontend.set_vring_addr(
                q,
                &VringConfigData {
                    queue_max_size: options.queue_size,
                    queue_size: options.queue_size,
                    flags: 0,
                    desc_table_addr: host_base + layout.desc_table,
                    used_ring_addr: host_base + layout.used_ring,
                    avail_ring_addr: host_base + layout.avail_ring,
                    log_addr: None,
                },
            )?;
            frontend.set_vring_base(q, 0)?;
            let call = EventFd::new(EFD_NONBLOCK)?;
            let kick = EventFd::new(0)?;
            frontend.set_vring_call(q, &call)?;
            frontend.set_vring_kick(q, &kick)?;
            if acked_features & F_PROTOCOL_FEATURES != 0 {
                frontend.set_vring_enable(q, true)?;
            }
            let call_wait = Epoll::new()?;
            call_wait.ctl(
                ControlOperation::Add,
                call.as_raw_fd(),
                EpollEvent::new(EventSet::IN, 0),
            )?;
            let arena_start = RINGS_BYTES + arena_bytes * q as u64;
            queues.push(QueueDriver::new(
                mem.clone(),
                DriverQueue::new(layout),
                kick,
                call,
                call_wait,
                (
                    acked_features & F_EVENT_IDX != 0,
                    acked_features & F_INDIRECT_DESC != 0,
                ),
                arena_start,
                arena_start + arena_bytes,
            ));
        }
        Ok(VhostUserBlkClient {
            frontend,
            mem,
            queues,
            config,
            acked_features,
        })
    }

    /// The virtio features both sides agreed on.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Whether EVENT_IDX was negotiated.
    pub fn event_idx(&self) -> bool {
        self.acked_features & F_EVENT_IDX != 0
    }

    /// The device's config space as read at connect (`virtio_blk_config`).
    pub fn config(&self) -> &[u8] {
        &self.config
    }

    /// The capacity the config space reports, in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        let mut sectors = [0u8; 8];
        if let Some(bytes) = self.config.get(0..8) {
            sectors.copy_from_slice(bytes);
        }
        u64::from_le_bytes(sectors) * 512
    }

    /// `num_queues` from the config space.
    pub fn config_num_queues(&self) -> u16 {
        match self.config.get(34..36) {
            Some(b) => u16::from_le_bytes([b[0], b[1]]),
            None => 0,
        }
    }

    /// Room for `len` bytes in queue `q`'s buffers (all of them free again once every chain
    /// of the queue is used).
    pub fn alloc(&mut self, q: usize, len: u32) -> Result<u64, VhostUserError> {
        self.queues[q].alloc(len)
    }

    /// Writes `data` into the shared memory at `addr`.
    pub fn write_mem(&self, addr: u64, data: &[u8]) -> Result<(), VhostUserError> {
        self.mem
            .write_slice(data, GuestAddress(addr))
            .map_err(mem_err)
    }

    /// Reads `len` bytes of the shared memory at `addr`.
    pub fn read_mem(&self, addr: u64, len: u32) -> Result<Vec<u8>, VhostUserError> {
        let mut out = vec![0u8; len as usize];
        self.mem
            .read_slice(&mut out, GuestAddress(addr))
            .map_err(mem_err)?;
        Ok(out)
    }

    /// A request header in queue `q`'s buffers.
    pub fn header(
        &mut self,
        q: usize,
        request_type: u32,
        sector: u64,
    ) -> Result<Buffer, VhostUserError> {
        let addr = self.alloc(q, 16)?;
        self.queues[q].write_header(addr, request_type, sector)?;
        Ok(Buffer {
            addr,
            len: 16,
            device_writes: false,
        })
    }

    /// A status byte in queue `q`'s buffers (set to 0xFF, which no status is).
    pub fn status_buffer(&mut self, q: usize) -> Result<Buffer, VhostUserError> {
        let addr = self.alloc(q, 1)?;
        self.write_mem(addr, &[0xFF])?;
        Ok(Buffer {
            addr,
            len: 1,
            device_writes: true,
        })
    }

    /// Makes `buffers` available on queue `q` as one chain and kicks: the device sees
    /// exactly these descriptors (a test builds bad ones this way). `status_addr` and
    /// `read_back` say what [`VhostUserBlkClient::wait`] reads when it is used.
    pub fn submit_chain(
        &mut self,
        q: usize,
        buffers: &[Buffer],
        status_addr: u64,
        read_back: Option<(u64, u32)>,
    ) -> Result<u16, VhostUserError> {
        self.queues[q].submit_chain(buffers, status_addr, read_back)
    }

    /// Builds `op`'s chain on queue `q` and submits it.
    pub fn submit(&mut self, q: usize, op: &BlkOp) -> Result<u16, VhostUserError> {
        let (buffers, status_addr, read_back) = self.build(q, op)?;
        self.submit_chain(q, &buffers, status_addr, read_back)
    }

    /// Builds `op`'s chain on queue `q` and makes it available without a kick (a kick lost
    /// on the way, for a test of the device's watchdog).
    pub fn submit_unkicked(&mut self, q: usize, op: &BlkOp) -> Result<u16, VhostUserError> {
        let (buffers, status_addr, read_back) = self.build(q, op)?;
        self.queues[q].post_unkicked(&buffers, status_addr, read_back)
    }

    /// Asks queue `q`'s device to signal the next used chain ([`QueueDriver::arm_signal`]).
    pub fn arm_signal(&mut self, q: usize) -> Result<(), VhostUserError> {
        self.queues[q].arm_signal()
    }

    /// Waits for a signal of queue `q`'s call eventfd, at most `timeout_ms`, and takes it
    /// ([`QueueDriver::wait_signal`]); whether one came.
    pub fn wait_signal(&mut self, q: usize, timeout_ms: i32) -> Result<bool, VhostUserError> {
        self.queues[q].wait_signal(timeout_ms)
    }

    /// `op`'s chain in queue `q`'s buffers: the buffers, the status byte's address and what
    /// to read back once it is used.
    fn build(&mut self, q: usize, op: &BlkOp) -> Result<BuiltChain, VhostUserError> {
        let sector = |offset: u64| offset / 512;
        let mut buffers = Vec::with_capacity(3);
        let mut read_back = None;
        match op {
            BlkOp::Read { offset, len } => {
                buffers.push(self.header(q, T_IN, sector(*offset))?);
                let addr = self.alloc(q, *len)?;
                buffers.push(Buffer {
                    addr,
                    len: *len,
                    device_writes: true,
                });
                read_back = Some((addr, *len));
            }
            BlkOp::Write { offset, data } => {
                buffers.push(self.header(q, T_OUT, sector(*offset))?);
                let len = u32::try_from(data.len()).map_err(|_| VhostUserError::QueueFull)?;
                let addr = self.alloc(q, len)?;
                self.write_mem(addr, data)?;
                buffers.push(Buffer {
                    addr,
                    len,
                    device_writes: false,
                });
            }
            BlkOp::Flush => buffers.push(self.header(q, T_FLUSH, 0)?),
            BlkOp::GetId => {
                buffers.push(self.header(q, T_GET_ID, 0)?);
                let addr = self.alloc(q, 20)?;
                buffers.push(Buffer {
                    addr,
                    len: 20,
                    device_writes: true,
                });
                read_back = Some((addr, 20));
            }
            BlkOp::Discard { offset, len } | BlkOp::WriteZeroes { offset, len, .. } => {
                let (request_type, flags) = match op {
                    BlkOp::WriteZeroes { unmap: true, .. } => (T_WRITE_ZEROES, 1u32),
                    BlkOp::WriteZeroes { .. } => (T_WRITE_ZEROES, 0),
                    _ => (T_DISCARD, 0),
                };
                buffers.push(self.header(q, request_type, 0)?);
                let mut segment = [0u8; 16];
                segment[0..8].copy_from_slice(&sector(*offset).to_le_bytes());
                segment[8..12].copy_from_slice(&(len / 512).to_le_bytes());
                segment[12..16].copy_from_slice(&flags.to_le_bytes());
                let addr = self.alloc(q, 16)?;
                self.write_mem(addr, &segment)?;
                buffers.push(Buffer {
                    addr,
                    len: 16,
                    device_writes: false,
                });
            }
        }
        let status = self.status_buffer(q)?;
        buffers.push(status);
        Ok((buffers, status.addr, read_back))
    }

    /// Waits for the next chain queue `q`'s device returns used (in the device's order).
    pub fn wait(&mut self, q: usize) -> Result<BlkCompletion, VhostUserError> {
        self.queues[q].wait()
    }

    /// Submits `op` on queue `q` and waits for it (nothing else may be in flight there).
    pub fn call(&mut self, q: usize, op: &BlkOp) -> Result<BlkCompletion, VhostUserError> {
        let head = self.submit(q, op)?;
        let done = self.wait(q)?;
        if done.head != head {
            return Err(VhostUserError::Protocol("another chain came back"));
        }
        Ok(done)
    }

    /// Chains of queue `q` in flight.
    pub fn in_flight(&self, q: usize) -> usize {
        self.queues[q].in_flight()
    }

    /// Hands the queues out, each to be driven on its own (a thread per queue, as a guest's
    /// blk-mq does), and keeps the protocol socket in the [`VhostUserConnection`]. Queue `q`
    /// is the vector's `q`-th.
    pub fn into_queues(self) -> (VhostUserConnection, Vec<QueueDriver>) {
        let capacity_bytes = self.capacity_bytes();
        let connection = VhostUserConnection {
            frontend: self.frontend,
            num_queues: self.queues.len(),
            capacity_bytes,
        };
        (connection, self.queues)
    }

    /// Says goodbye: the device may stop its queues (GET_VRING_BASE) before the socket
    /// closes.
    pub fn disconnect(self) -> Result<(), VhostUserError> {
        for q in 0..self.queues.len() {
            self.frontend.get_vring_base(q)?;
        }
        Ok(())
    }
}

/// The protocol socket of a device whose queues were handed out
/// ([`VhostUserBlkClient::into_queues`]).
pub struct VhostUserConnection {
    frontend: Frontend,
    num_queues: usize,
    capacity_bytes: u64,
}

impl std::fmt::Debug for VhostUserConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserConnection")
            .field("num_queues", &self.num_queues)
            .field("capacity_bytes", &self.capacity_bytes)
            .finish_non_exhaustive()
    }
}

impl VhostUserConnection {
    /// The capacity the config space reported at connect, in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Stops every queue (GET_VRING_BASE) before the socket closes; the queues' drivers
    /// should have nothing in flight by then.
    pub fn disconnect(self) -> Result<(), VhostUserError> {
        for q in 0..self.num_queues {
            self.frontend.get_vring_base(q)?;
        }
        Ok(())
    }
}

/// A memfd of `bytes` mapped shared, as QEMU's `memory-backend-memfd,share=on`.
fn shared_memory(bytes: u64) -> Result<GuestMemoryMmap<()>, VhostUserError> {
    let fd = rustix::fs::memfd_create("headroom-vhost-user", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(std::io::Error::from)?;
    let file = File::from(fd);
    file.set_len(bytes)?;
    let size = usize::try_from(bytes).map_err(mem_err)?;
    GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        size,
        Some(FileOffset::new(file, 0)),
    )])
    .map_err(mem_err)
}
