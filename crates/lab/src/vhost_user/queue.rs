//! One virtqueue of a connected vhost-user-blk device as its driver holds it: the rings
//! (`virtqueue`), the kick and call eventfds, the queue's share of the shared memory and
//! what it remembers of each chain in flight.
//!
//! Why a value of its own: a virtio-blk driver keeps each queue's requests independently
//! (blk-mq: one queue per vCPU), so a load generator drives each queue from a thread of its
//! own over one connection. [`super::VhostUserBlkClient::into_queues`] hands the queues out
//! (each holds a handle of the same shared memory); the connection keeps the protocol
//! socket. Two ways to use a queue: the blocking one the tests use (`submit`, `wait`: the
//! client's methods call these), and the driver's loop a load generator runs without
//! allocating: chains over buffers reserved once ([`QueueDriver::reserve`],
//! [`QueueDriver::post_chain`]), one kick for a batch and only when the device asks for it
//! ([`QueueDriver::kick`]), every used chain reaped at once ([`QueueDriver::reap`]) and a
//! blocking wait on the call eventfd that re-arms EVENT_IDX's `used_event` first
//! ([`QueueDriver::wait_call`]).

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use super::virtqueue::{self, Buffer, DriverQueue};
use super::{ANSWER_TIMEOUT_MS, BlkCompletion, VhostUserError, mem_err};

/// What the driver must remember of a chain in flight.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    status_addr: u64,
    read_back: Option<(u64, u32)>,
}

/// A used chain as [`QueueDriver::reap`] returns it: no data copied out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reaped {
    pub head: u16,
    pub status: u8,
    /// The used element's length: what the device says it wrote.
    pub written_bytes: u32,
}

/// One queue of a device, owned by whoever drives it.
#[derive(Debug)]
pub struct QueueDriver {
    mem: GuestMemoryMmap<()>,
    ring: DriverQueue,
    kick: EventFd,
    call: EventFd,
    /// Waits on `call` with a bound.
    call_wait: Epoll,
    event_idx: bool,
    /// Chains of more than one buffer go through an indirect table (negotiated
    /// `VIRTIO_RING_F_INDIRECT_DESC`), as Linux's driver sends them.
    indirect: bool,
    /// Buffers from here to `arena_end` are handed out per request and all free again once
    /// nothing is in flight; below it, [`QueueDriver::reserve`]'s, kept for good.
    arena_start: u64,
    arena_end: u64,
    arena_next: u64,
    /// By head.
    in_flight: Vec<Option<InFlight>>,
    in_flight_count: usize,
}

impl QueueDriver {
    #[allow(clippy::too_many_arguments)] // the parts connect set up, moved in once
    pub(super) fn new(
        mem: GuestMemoryMmap<()>,
        ring: DriverQueue,
        kick: EventFd,
        call: EventFd,
        call_wait: Epoll,
        (event_idx, indirect): (bool, bool),
        arena_start: u64,
        arena_end: u64,
    ) -> QueueDriver {
        let size = usize::from(ring.layout.size);
        QueueDriver {
            mem,
            ring,
            kick,
            call,
            call_wait,
            event_idx,
            indirect,
            arena_start,
            arena_end,
            arena_next: arena_start,
            in_flight: vec![None; size],
            in_flight_count: 0,
        }
    }

    /// The queue's size (descriptors).
    pub fn size(&self) -> u16 {
        self.ring.layout.size
    }

    /// Chains in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight_count
    }

    /// Room for `len` bytes of per-request buffers (all free again once every chain of the
    /// queue is used).
    pub fn alloc(&mut self, len: u32) -> Result<u64, VhostUserError> {
        let at = self.arena_next.next_multiple_of(64);
        let end = at + u64::from(len.max(1));
        if end > self.arena_end {
            return Err(VhostUserError::QueueFull);
        }
        self.arena_next = end;
        Ok(at)
    }

    /// Room for `len` bytes kept for good (a load generator's buffers, set up once). Only
    /// while nothing is in flight, since it moves the start of the per-request buffers.
    pub fn reserve(&mut self, len: u32) -> Result<u64, VhostUserError> {
        if self.in_flight_count != 0 {
            return Err(VhostUserError::Protocol(
                "reserve with chains in flight (use alloc)",
            ));
        }
        let at = self.arena_start.next_multiple_of(64);
        let end = at + u64::from(len.max(1));
        if end > self.arena_end {
            return Err(VhostUserError::QueueFull);
        }
        self.arena_start = end;
        self.arena_next = end;
        Ok(at)
    }

    /// Writes `data` into the shared memory at `addr`.
    pub fn write_mem(&self, addr: u64, data: &[u8]) -> Result<(), VhostUserError> {
        self.mem
            .write_slice(data, GuestAddress(addr))
            .map_err(mem_err)
    }

    /// Writes a virtio-blk request header (type, sector) at `addr`, 16 bytes.
    pub fn write_header(
        &self,
        addr: u64,
        request_type: u32,
        sector: u64,
    ) -> Result<(), VhostUserError> {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&request_type.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.write_mem(addr, &h)
    }

    /// Makes `buffers` available as one chain without kicking; `status_addr` is the byte
    /// [`QueueDriver::reap`] reads when it is used. The status byte is set to 0xFF (no
    /// status is) so a device that returns the chain without writing it shows as an error.
    pub fn post_chain(
        &mut self,
        buffers: &[Buffer],
        status_addr: u64,
    ) -> Result<u16, VhostUserError> {
        self.write_mem(status_addr, &[0xFF])?;
        self.post(buffers, status_addr, None)
    }

    fn post(
        &mut self,
        buffers: &[Buffer],
        status_addr: u64,
        read_back: Option<(u64, u32)>,
    ) -> Result<u16, VhostUserError> {
        let head = if self.indirect && buffers.len() > 1 {
            let table_bytes = buffers.len() as u64 * virtqueue::DESCRIPTOR_BYTES;
            let table =
                self.alloc(u32::try_from(table_bytes).map_err(|_| VhostUserError::QueueFull)?)?;
            self.ring.push_indirect(&self.mem, buffers, table)?
        } else {
            self.ring.push(&self.mem, buffers)?
        };
        let slot = &mut self.in_flight[usize::from(head)];
        if slot.is_none() {
            self.in_flight_count += 1;
        }
        *slot = Some(InFlight {
            status_addr,
            read_back,
        });
        Ok(head)
    }

    /// Kicks the device if the chains posted since the last kick need it (always without
    /// EVENT_IDX; with it, when the device's `avail_event` asks). Whether it kicked.
    pub fn kick(&mut self) -> Result<bool, VhostUserError> {
        if self.ring.needs_kick(&self.mem, self.event_idx)? {
            self.kick.write(1)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Makes `buffers` available as one chain and does not kick, whatever the device asked:
    /// a kick lost on the way, as a test needs it. `read_back` as [`QueueDriver::submit_chain`].
    pub fn post_unkicked(
        &mut self,
        buffers: &[Buffer],
        status_addr: u64,
        read_back: Option<(u64, u32)>,
    ) -> Result<u16, VhostUserError> {
        self.post(buffers, status_addr, read_back)
    }

    /// Asks the device (EVENT_IDX) to signal once it has used the next chain not reaped yet,
    /// as a driver re-enabling its callback does; [`QueueDriver::wait_call`] does it itself.
    pub fn arm_signal(&mut self) -> Result<(), VhostUserError> {
        self.ring.arm_used_event(&self.mem)
    }

    /// Blocks until the device signals the call eventfd, at most `timeout_ms`, and takes the
    /// signal; nothing is armed or checked first (a test counting signals). Whether one came.
    pub fn wait_signal(&mut self, timeout_ms: i32) -> Result<bool, VhostUserError> {
        let mut events = [EpollEvent::default()];
        let ready = self.call_wait.wait(timeout_ms, &mut events)?;
        let _ = self.call.read();
        Ok(ready != 0)
    }

    /// Posts `buffers` as one chain and kicks unconditionally (the blocking client's way,
    /// and a test's for chains it builds by hand).
    pub fn submit_chain(
        &mut self,
        buffers: &[Buffer],
        status_addr: u64,
        read_back: Option<(u64, u32)>,
    ) -> Result<u16, VhostUserError> {
        let head = self.post(buffers, status_addr, read_back)?;
        // Counted kicked, whatever avail_event says.
        let _ = self.ring.needs_kick(&self.mem, false)?;
        self.kick.write(1)?;
        Ok(head)
    }

    /// The next used chain, if there is one: its bookkeeping taken, its status read.
    fn pop(&mut self) -> Result<Option<(Reaped, InFlight)>, VhostUserError> {
        let Some((head, written_bytes)) = self.ring.pop_used(&self.mem)? else {
            return Ok(None);
        };
        let done = self.in_flight[usize::from(head)]
            .take()
            .ok_or(VhostUserError::Protocol("a used chain not submitted"))?;
        self.in_flight_count -= 1;
        let status: u8 = self
            .mem
            .read_obj(GuestAddress(done.status_addr))
            .map_err(mem_err)?;
        Ok(Some((
            Reaped {
                head,
                status,
                written_bytes,
            },
            done,
        )))
    }

    /// Every chain the device has used so far, in its order, appended to `out` (the
    /// caller's vector, reused: nothing is allocated once it has room for the queue's
    /// size). How many.
    pub fn reap(&mut self, out: &mut Vec<Reaped>) -> Result<usize, VhostUserError> {
        let mut n = 0;
        while let Some((reaped, _)) = self.pop()? {
            out.push(reaped);
            n += 1;
        }
        if self.in_flight_count == 0 {
            self.arena_next = self.arena_start;
        }
        Ok(n)
    }

    /// Blocks until the device signals the call eventfd or has used a chain not yet reaped
    /// (checked after arming, so a chain used meanwhile is not missed), at most
    /// `timeout_ms`. With EVENT_IDX, first asks for a signal at the next used chain
    /// (`used_event`), as a driver re-enabling its callback does. Whether it woke for
    /// something (false: the time ran out).
    pub fn wait_call(&mut self, timeout_ms: i32) -> Result<bool, VhostUserError> {
        if self.event_idx {
            self.ring.arm_used_event(&self.mem)?;
        }
        // A chain used before arming would not be signalled.
        if self.ring.pop_used_pending(&self.mem)? {
            return Ok(true);
        }
        let mut events = [EpollEvent::default()];
        let ready = self.call_wait.wait(timeout_ms, &mut events)?;
        let _ = self.call.read();
        Ok(ready != 0)
    }

    /// Waits for the next chain the device returns used (in the device's order), with its
    /// data read back.
    pub fn wait(&mut self) -> Result<BlkCompletion, VhostUserError> {
        loop {
            if let Some((reaped, done)) = self.pop()? {
                // Read below before anything new is built there.
                let data = match done.read_back {
                    Some((addr, len)) => {
                        let mut out = vec![0u8; len as usize];
                        self.mem
                            .read_slice(&mut out, GuestAddress(addr))
                            .map_err(mem_err)?;
                        out
                    }
                    None => Vec::new(),
                };
                if self.in_flight_count == 0 {
                    self.arena_next = self.arena_start;
                }
                return Ok(BlkCompletion {
                    head: reaped.head,
                    status: reaped.status,
                    data,
                    written_bytes: reaped.written_bytes,
                });
            }
            if !self.wait_call(ANSWER_TIMEOUT_MS)? {
                return Err(VhostUserError::Timeout);
            }
        }
    }
}
