//! A pool of payload buffers, so the data path neither zeroes nor page-faults fresh memory on
//! every request.
//!
//! Profiling 128 KiB reads showed ~10 % of server time in page faults and memset: each reply
//! buffer was a fresh `calloc` that glibc served from new pages. Buffers here come in
//! power-of-two classes from 4 KiB to the maximum request size; a returned buffer keeps its
//! full length, so handing it out again costs a pop and nothing else (the store overwrites
//! every byte a read returns, and a write payload is read into it in full). Each class keeps
//! at most `BYTES_PER_CLASS` worth of idle buffers (at least one), and all classes together
//! at most `IDLE_BYTES_MAX`, so the pool's idle memory is bounded (BurstCBS §1.3 keeps the same
//! two concerns apart: no allocation on the hot path, bounded memory when a burst ends).
//!
//! Buffers in use are not bounded here: a session charges each request
//! [`BufferPool::charge_bytes`] against its byte budgets (`node::budget`) before it takes one.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

const MIN_CLASS_BYTES: usize = 4 << 10;
/// Idle bytes kept per size class (at least one buffer of any class).
const BYTES_PER_CLASS: usize = 32 << 20;
/// Idle bytes kept by the whole pool.
pub const IDLE_BYTES_MAX: usize = 64 << 20;

/// Buffers by size class.
#[derive(Debug)]
pub struct BufferPool {
    classes: Vec<Mutex<Vec<Vec<u8>>>>,
    /// Bytes of the buffers kept idle in all classes.
    idle_bytes: AtomicUsize,
}

/// A buffer whose first `len` bytes are the payload.
#[derive(Debug)]
pub struct PooledBuffer {
    data: Vec<u8>,
    len: usize,
}

/// For the store's asynchronous I/O (`Volume::start_async`), which owns the buffer while
/// the cluster works on it.
impl AsMut<[u8]> for PooledBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl PooledBuffer {
    pub fn as_slice(&self) -> &[u8] {
        &self.data[..self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.data[..self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl BufferPool {
    /// A pool for payloads up to `max_bytes`.
    pub fn new(max_bytes: usize) -> BufferPool {
        let mut classes = Vec::new();
        let mut class = MIN_CLASS_BYTES;
        loop {
            classes.push(Mutex::new(Vec::new()));
            if class >= max_bytes {
                break;
            }
            class *= 2;
        }
        BufferPool {
            classes,
            idle_bytes: AtomicUsize::new(0),
        }
    }

    /// The bytes a payload of `len` bytes occupies while in flight: its buffer's class (the
    /// next power of two, at least 4 KiB). What sessions charge against their byte budgets.
    pub fn charge_bytes(len: u32) -> u64 {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        u64::try_from(Self::class_index(len).1).unwrap_or(u64::MAX)
    }

    /// Bytes of the buffers kept for reuse now.
    pub fn idle_bytes(&self) -> usize {
        self.idle_bytes.load(Ordering::Relaxed)
    }

    fn class_index(len: usize) -> (usize, usize) {
        let class_bytes = len.max(MIN_CLASS_BYTES).next_power_of_two();
        let index = (class_bytes.trailing_zeros() - MIN_CLASS_BYTES.trailing_zeros()) as usize;
        (index, class_bytes)
    }

    /// A buffer of `len` bytes with unspecified contents.
    pub fn get(&self, len: usize) -> PooledBuffer {
        let (index, class_bytes) = Self::class_index(len);
        let reused = self.classes.get(index).and_then(|class| {
            let popped = match class.lock() {
                Ok(mut idle) => idle.pop(),
                Err(poisoned) => poisoned.into_inner().pop(),
            };
            if popped.is_some() {
                self.idle_bytes.fetch_sub(class_bytes, Ordering::Relaxed);
            }
            popped
        });
        let data = reused.unwrap_or_else(|| vec![0u8; class_bytes]);
        PooledBuffer { data, len }
    }

    /// Returns a buffer for reuse (dropped if its class is full or it is not from a class).
    pub fn put(&self, buffer: PooledBuffer) {
        let (index, class_bytes) = Self::class_index(buffer.data.len());
        if buffer.data.len() != class_bytes {
            return;
        }
        let Some(class) = self.classes.get(index) else {
            return;
        };
        let keep = (BYTES_PER_CLASS / class_bytes).max(1);
        let mut idle = match class.lock() {
            Ok(idle) => idle,
            Err(poisoned) => poisoned.into_inner(),
        };
        if idle.len() >= keep {
            return;
        }
        // Reserve room in the pool-wide bound first; without it the buffer is freed.
        let reserved = self
            .idle_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(class_bytes)
                    .filter(|&total| total <= IDLE_BYTES_MAX)
            });
        if reserved.is_ok() {
            idle.push(buffer.data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_within_their_class() {
        let pool = BufferPool::new(32 << 20);
        let mut first = pool.get(5000);
        assert_eq!(first.len(), 5000);
        first.as_mut_slice().fill(7);
        let address = first.as_slice().as_ptr();
        pool.put(first);
        let second = pool.get(8192);
        assert_eq!(
            second.as_slice().as_ptr(),
            address,
            "same 8 KiB class buffer"
        );
        assert_eq!(second.len(), 8192);
        let other = pool.get(4096);
        assert_ne!(other.as_slice().as_ptr(), address);
    }

    #[test]
    fn idle_memory_is_bounded() {
        let pool = BufferPool::new(32 << 20);
        let buffers: Vec<_> = (0..10).map(|_| pool.get(32 << 20)).collect();
        for buffer in buffers {
            pool.put(buffer);
        }
        let idle = pool.classes.last().unwrap().lock().unwrap().len();
        assert_eq!(idle, 1, "one kept: 32 MiB per class");
        let small: Vec<_> = (0..10_000).map(|_| pool.get(4096)).collect();
        for buffer in small {
            pool.put(buffer);
        }
        assert_eq!(pool.classes[0].lock().unwrap().len(), (32 << 20) / 4096);
        assert_eq!(pool.idle_bytes(), 64 << 20);
        // The pool-wide bound: 64 MiB are idle, so nothing more is kept.
        let more: Vec<_> = (0..4).map(|_| pool.get(1 << 20)).collect();
        for buffer in more {
            pool.put(buffer);
        }
        assert_eq!(pool.idle_bytes(), IDLE_BYTES_MAX);
        assert!(pool.classes[8].lock().unwrap().is_empty());
        // Taking a buffer frees its bytes from the bound.
        let taken = pool.get(4096);
        assert_eq!(pool.idle_bytes(), IDLE_BYTES_MAX - 4096);
        drop(taken);
    }

    #[test]
    fn charges_are_buffer_sizes() {
        assert_eq!(BufferPool::charge_bytes(0), 4096);
        assert_eq!(BufferPool::charge_bytes(1), 4096);
        assert_eq!(BufferPool::charge_bytes(4097), 8192);
        assert_eq!(BufferPool::charge_bytes(20 << 20), 32 << 20);
        assert_eq!(BufferPool::charge_bytes(32 << 20), 32 << 20);
    }

    #[test]
    fn sizes_map_to_classes() {
        assert_eq!(BufferPool::class_index(1), (0, 4096));
        assert_eq!(BufferPool::class_index(4096), (0, 4096));
        assert_eq!(BufferPool::class_index(4097), (1, 8192));
        assert_eq!(BufferPool::class_index(32 << 20), (13, 32 << 20));
    }
}
