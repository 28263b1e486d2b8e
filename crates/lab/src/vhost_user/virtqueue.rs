//! The driver's side of one split virtqueue in shared memory: the descriptor table, the
//! available ring the driver fills and the used ring the device fills, as a guest's
//! virtio driver keeps them.
//!
//! Why written here rather than taken from a crate: rust-vmm's virtqueue crate is the
//! device's side (it pops what a driver made available); a client of a vhost-user device in
//! the lab needs the driver's side, which is a few dozen lines of the virtio spec (2.7,
//! "Split Virtqueues"). Indices are read and written with atomic loads and stores, since the
//! device runs on other threads over the same memory; EVENT_IDX is honoured both ways, as
//! Linux's `virtio_ring` does: `used_event` is written before waiting, and a kick is sent
//! only when the device's `avail_event` asks for one. Nothing here allocates once the queue
//! exists (a chain's descriptors are linked through `next`, not kept in a vector of its
//! own), so a load generator can push and pop millions of chains without touching the heap.

use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::VhostUserError;

/// VRING_DESC_F_NEXT, VRING_DESC_F_WRITE and VRING_DESC_F_INDIRECT.
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const DESC_F_INDIRECT: u16 = 4;

/// Bytes of one descriptor, in the ring's table or an indirect one.
pub const DESCRIPTOR_BYTES: u64 = 16;

/// One descriptor as the split ring lays it out.
fn descriptor(addr: u64, len: u32, flags: u16, next: u16) -> [u8; 16] {
    let mut raw = [0u8; 16];
    raw[0..8].copy_from_slice(&addr.to_le_bytes());
    raw[8..12].copy_from_slice(&len.to_le_bytes());
    raw[12..14].copy_from_slice(&flags.to_le_bytes());
    raw[14..16].copy_from_slice(&next.to_le_bytes());
    raw
}

/// One buffer of a chain: where it is in shared memory, how long, and whether the device
/// writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffer {
    pub addr: u64,
    pub len: u32,
    pub device_writes: bool,
}

/// Where a queue's rings lie in the shared memory.
#[derive(Clone, Copy, Debug)]
pub struct RingLayout {
    pub size: u16,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl RingLayout {
    /// Bytes the three parts take, each 4 KiB aligned, from `base`.
    pub fn at(base: u64, size: u16) -> RingLayout {
        let size_bytes = u64::from(size);
        let align = |n: u64| n.div_ceil(4096) * 4096;
        let desc_table = base;
        let avail_ring = desc_table + align(16 * size_bytes);
        let used_ring = avail_ring + align(6 + 2 * size_bytes);
        RingLayout {
            size,
            desc_table,
            avail_ring,
            used_ring,
        }
    }

    /// Bytes from `desc_table` to the end of the used ring.
    pub fn span_bytes(&self) -> u64 {
        let used_bytes = 6 + 8 * u64::from(self.size);
        self.used_ring + used_bytes.div_ceil(4096) * 4096 - self.desc_table
    }
}

/// The driver's state of one queue.
#[derive(Debug)]
pub struct DriverQueue {
    pub layout: RingLayout,
    free: Vec<u16>,
    next_avail: u16,
    last_used: u16,
    /// The available index as of the last kick.
    kicked_avail: u16,
    /// Per descriptor, the next one of its chain (meaningful while the chain is in flight).
    next: Vec<u16>,
    /// Per head, how many descriptors its chain in flight holds (0: not in flight).
    chain_len: Vec<u16>,
}

fn mem_err(err: impl std::fmt::Display) -> VhostUserError {
    VhostUserError::Memory(err.to_string())
}

impl DriverQueue {
    pub fn new(layout: RingLayout) -> DriverQueue {
        DriverQueue {
            layout,
            free: (0..layout.size).rev().collect(),
            next_avail: 0,
            last_used: 0,
            kicked_avail: 0,
            next: vec![0; usize::from(layout.size)],
            chain_len: vec![0; usize::from(layout.size)],
        }
    }

    /// Descriptors free for new chains.
    pub fn free_descriptors(&self) -> usize {
        self.free.len()
    }

    /// Makes `buffers` available as one chain through an indirect table written at `table`
    /// (`buffers.len()` descriptors, [`DESCRIPTOR_BYTES`] each): the chain takes one
    /// descriptor of the ring however many buffers it has (`VIRTIO_RING_F_INDIRECT_DESC`).
    pub fn push_indirect(
        &mut self,
        mem: &GuestMemoryMmap<()>,
        buffers: &[Buffer],
        table: u64,
    ) -> Result<u16, VhostUserError> {
        let n = u16::try_from(buffers.len()).map_err(|_| VhostUserError::QueueFull)?;
        if n == 0 {
            return Err(VhostUserError::QueueFull);
        }
        for (i, buffer) in (0u16..).zip(buffers) {
            let mut flags = if buffer.device_writes {
                DESC_F_WRITE
            } else {
                0
            };
            let next = if i + 1 < n {
                flags |= DESC_F_NEXT;
                i + 1
            } else {
                0
            };
            let raw = descriptor(buffer.addr, buffer.len, flags, next);
            let at = table + DESCRIPTOR_BYTES * u64::from(i);
            mem.write_slice(&raw, GuestAddress(at)).map_err(mem_err)?;
        }
        let table_buffer = Buffer {
            addr: table,
            len: u32::from(n) * DESCRIPTOR_BYTES as u32,
            device_writes: false,
        };
        self.push_flagged(mem, &[table_buffer], DESC_F_INDIRECT)
    }

    /// Writes `buffers` as one chain and makes it available; its head. The device is not
    /// kicked: [`DriverQueue::needs_kick`] says whether it must be.
    pub fn push(
        &mut self,
        mem: &GuestMemoryMmap<()>,
        buffers: &[Buffer],
    ) -> Result<u16, VhostUserError> {
        self.push_flagged(mem, buffers, 0)
    }

    /// [`DriverQueue::push`] with `extra_flags` on every descriptor of the chain.
    fn push_flagged(
        &mut self,
        mem: &GuestMemoryMmap<()>,
        buffers: &[Buffer],
        extra_flags: u16,
    ) -> Result<u16, VhostUserError> {
        let n = buffers.len();
        if n == 0 || n > self.free.len() {
            return Err(VhostUserError::QueueFull);
        }
        // The chain takes the last `n` free descriptors, the last one first (a stack).
        let top = self.free.len();
        let pick = |i: usize| self.free[top - 1 - i];
        for (i, buffer) in buffers.iter().enumerate() {
            let index = pick(i);
            let mut flags = extra_flags
                | if buffer.device_writes {
                    DESC_F_WRITE
                } else {
                    0
                };
            let next = if i + 1 < n {
                flags |= DESC_F_NEXT;
                pick(i + 1)
            } else {
                0
            };
            self.next[usize::from(index)] = next;
            let raw = descriptor(buffer.addr, buffer.len, flags, next);
            let at = self.layout.desc_table + DESCRIPTOR_BYTES * u64::from(index);
            mem.write_slice(&raw, GuestAddress(at)).map_err(mem_err)?;
        }
        let head = pick(0);
        self.free.truncate(top - n);
        // n <= free.len() <= size, a u16.
        self.chain_len[usize::from(head)] = n as u16;
        let slot = self.next_avail % self.layout.size;
        let ring_at = self.layout.avail_ring + 4 + 2 * u64::from(slot);
        mem.store(head, GuestAddress(ring_at), Ordering::Release)
            .map_err(mem_err)?;
        self.next_avail = self.next_avail.wrapping_add(1);
        mem.store(
            self.next_avail,
            GuestAddress(self.layout.avail_ring + 2),
            Ordering::SeqCst,
        )
        .map_err(mem_err)?;
        Ok(head)
    }

    /// Whether the chains made available since the last kick need one, and if so counts them
    /// kicked. Without EVENT_IDX every new chain does; with it, only when the device's
    /// `avail_event` (written as it goes to sleep) lies among them (the spec's
    /// `vring_need_event`). The index was published with a sequentially consistent store
    /// and `avail_event` is read with one, so a device that re-enabled notifications after
    /// that store is seen here, and one that did so before sees the new index.
    pub fn needs_kick(
        &mut self,
        mem: &GuestMemoryMmap<()>,
        event_idx: bool,
    ) -> Result<bool, VhostUserError> {
        let old = self.kicked_avail;
        let new = self.next_avail;
        if old == new {
            return Ok(false);
        }
        self.kicked_avail = new;
        if !event_idx {
            return Ok(true);
        }
        let at = self.layout.used_ring + 4 + 8 * u64::from(self.layout.size);
        let avail_event: u16 = mem
            .load(GuestAddress(at), Ordering::SeqCst)
            .map_err(mem_err)?;
        Ok(new.wrapping_sub(avail_event).wrapping_sub(1) < new.wrapping_sub(old))
    }

    /// The next used chain, if the device has returned one: its head and the bytes it wrote.
    pub fn pop_used(
        &mut self,
        mem: &GuestMemoryMmap<()>,
    ) -> Result<Option<(u16, u32)>, VhostUserError> {
        let used_idx: u16 = mem
            .load(GuestAddress(self.layout.used_ring + 2), Ordering::Acquire)
            .map_err(mem_err)?;
        if used_idx == self.last_used {
            return Ok(None);
        }
        let slot = self.last_used % self.layout.size;
        let elem_at = self.layout.used_ring + 4 + 8 * u64::from(slot);
        let id: u32 = mem
            .load(GuestAddress(elem_at), Ordering::Acquire)
            .map_err(mem_err)?;
        let len: u32 = mem
            .load(GuestAddress(elem_at + 4), Ordering::Acquire)
            .map_err(mem_err)?;
        self.last_used = self.last_used.wrapping_add(1);
        let head = u16::try_from(id)
            .ok()
            .filter(|h| *h < self.layout.size)
            .ok_or(VhostUserError::Protocol("a used id past the queue"))?;
        let n = std::mem::take(&mut self.chain_len[usize::from(head)]);
        if n == 0 {
            return Err(VhostUserError::Protocol("a used id that was not in flight"));
        }
        let mut index = head;
        for _ in 0..n {
            self.free.push(index);
            index = self.next[usize::from(index)];
        }
        Ok(Some((head, len)))
    }

    /// Whether the device has used a chain not yet popped.
    pub fn pop_used_pending(&self, mem: &GuestMemoryMmap<()>) -> Result<bool, VhostUserError> {
        let used_idx: u16 = mem
            .load(GuestAddress(self.layout.used_ring + 2), Ordering::SeqCst)
            .map_err(mem_err)?;
        Ok(used_idx != self.last_used)
    }

    /// Asks the device to signal once it has used the next chain (EVENT_IDX's `used_event`).
    pub fn arm_used_event(&self, mem: &GuestMemoryMmap<()>) -> Result<(), VhostUserError> {
        let at = self.layout.avail_ring + 4 + 2 * u64::from(self.layout.size);
        mem.store(self.last_used, GuestAddress(at), Ordering::SeqCst)
            .map_err(mem_err)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn buffers(n: usize) -> Vec<Buffer> {
        (0..n)
            .map(|i| Buffer {
                addr: 0x10_0000 + 4096 * i as u64,
                len: 512,
                device_writes: i + 1 == n,
            })
            .collect()
    }

    /// What a device does: returns `head` used with `len` bytes written.
    fn device_uses(mem: &GuestMemoryMmap<()>, layout: &RingLayout, used: &mut u16, head: u16) {
        let slot = *used % layout.size;
        let at = layout.used_ring + 4 + 8 * u64::from(slot);
        mem.store(u32::from(head), GuestAddress(at), Ordering::Release)
            .unwrap();
        mem.store(1u32, GuestAddress(at + 4), Ordering::Release)
            .unwrap();
        *used = used.wrapping_add(1);
        mem.store(*used, GuestAddress(layout.used_ring + 2), Ordering::Release)
            .unwrap();
    }

    #[test]
    fn chains_are_linked_and_their_descriptors_come_back_when_used() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let layout = RingLayout::at(0, 8);
        let mut q = DriverQueue::new(layout);
        let a = q.push(&mem, &buffers(3)).unwrap();
        let b = q.push(&mem, &buffers(3)).unwrap();
        assert_eq!(q.free_descriptors(), 2);
        assert!(matches!(
            q.push(&mem, &buffers(3)),
            Err(VhostUserError::QueueFull)
        ));
        // The chain as the device walks it: head, NEXT flags, the last one device-writable.
        let mut index = a;
        for i in 0..3 {
            let at = layout.desc_table + 16 * u64::from(index);
            let flags: u16 = mem.read_obj(GuestAddress(at + 12)).unwrap();
            let next: u16 = mem.read_obj(GuestAddress(at + 14)).unwrap();
            assert_eq!(flags & DESC_F_NEXT != 0, i < 2);
            assert_eq!(flags & DESC_F_WRITE != 0, i == 2);
            index = next;
        }
        let mut used = 0;
        device_uses(&mem, &layout, &mut used, b);
        assert_eq!(q.pop_used(&mem).unwrap(), Some((b, 1)));
        assert_eq!(q.free_descriptors(), 5);
        device_uses(&mem, &layout, &mut used, a);
        assert_eq!(q.pop_used(&mem).unwrap(), Some((a, 1)));
        assert_eq!(q.free_descriptors(), 8);
        assert_eq!(q.pop_used(&mem).unwrap(), None);
        // A head used twice is a broken device.
        device_uses(&mem, &layout, &mut used, a);
        assert!(q.pop_used(&mem).is_err());
        // Many rounds reuse the same descriptors (nothing leaks).
        let mut q = DriverQueue::new(layout);
        let mut used = 0;
        mem.store(0u16, GuestAddress(layout.used_ring + 2), Ordering::Release)
            .unwrap();
        for _ in 0..1000 {
            let h = q.push(&mem, &buffers(3)).unwrap();
            device_uses(&mem, &layout, &mut used, h);
            assert_eq!(q.pop_used(&mem).unwrap(), Some((h, 1)));
        }
        assert_eq!(q.free_descriptors(), 8);
    }

    #[test]
    fn a_kick_is_needed_when_avail_event_falls_in_the_batch() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let layout = RingLayout::at(0, 16);
        let avail_event_at = GuestAddress(layout.used_ring + 4 + 8 * 16);
        let mut q = DriverQueue::new(layout);
        assert!(!q.needs_kick(&mem, true).unwrap(), "nothing posted");
        // avail_event 0: the device sleeps waiting for index 0 to be made available.
        for _ in 0..3 {
            q.push(&mem, &buffers(1)).unwrap();
        }
        assert!(q.needs_kick(&mem, true).unwrap());
        // The device has not caught up (still asks for 0): no kick for 3..5.
        for _ in 0..2 {
            q.push(&mem, &buffers(1)).unwrap();
        }
        assert!(!q.needs_kick(&mem, true).unwrap());
        // An avail_event the driver already went past (4, in the batch 3..5 not kicked)
        // asks for nothing new.
        mem.store(4u16, avail_event_at, Ordering::SeqCst).unwrap();
        q.push(&mem, &buffers(1)).unwrap();
        assert!(!q.needs_kick(&mem, true).unwrap());
        // It consumed all six and sleeps until index 6 is made available: 6 is in the batch
        // 6..8, so kick.
        mem.store(6u16, avail_event_at, Ordering::SeqCst).unwrap();
        for _ in 0..2 {
            q.push(&mem, &buffers(1)).unwrap();
        }
        assert!(q.needs_kick(&mem, true).unwrap());
        // Without EVENT_IDX every batch is kicked.
        q.push(&mem, &buffers(1)).unwrap();
        assert!(q.needs_kick(&mem, false).unwrap());
    }
}
