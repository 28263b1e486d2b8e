//! The in-memory extent map of one volume: logical extent -> physical extent.
//!
//! Why: every read and write resolves its extent here, so a lookup must be a couple of loads,
//! never a lock or a database access (redb holds the durable copy). Entries are `AtomicU64`
//! (0 = hole, see `layout::PhysExtent::to_entry`; bit 63 = allocation not yet committed),
//! grouped in lazily created chunks so a sparse 64 TiB volume costs a few hundred KiB, not
//! 256 MiB. Entries change only under the pool mutex (allocation) or with the volume's write
//! lock held (release, resize), so readers need just the volume's read lock.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Extents per lazily allocated chunk (8 KiB of entries, 2 GiB of logical space).
pub(crate) const CHUNK_EXTENTS: u64 = 1024;

#[derive(Debug)]
pub(crate) struct ExtentMap {
    chunks: Vec<OnceLock<Box<[AtomicU64]>>>,
    extent_count: u64,
}

fn new_chunk() -> Box<[AtomicU64]> {
    (0..CHUNK_EXTENTS).map(|_| AtomicU64::new(0)).collect()
}

impl ExtentMap {
    pub(crate) fn new(extent_count: u64) -> ExtentMap {
        let mut m = ExtentMap {
            chunks: Vec::new(),
            extent_count: 0,
        };
        m.resize(extent_count);
        m
    }

    pub(crate) fn extent_count(&self) -> u64 {
        self.extent_count
    }

    /// The entry of `extent` (0 for holes and for indexes past the end).
    #[inline]
    pub(crate) fn get(&self, extent: u64) -> u64 {
        if extent >= self.extent_count {
            return 0;
        }
        let chunk = (extent / CHUNK_EXTENTS) as usize;
        match self.chunks.get(chunk).and_then(OnceLock::get) {
            Some(c) => c
                .get((extent % CHUNK_EXTENTS) as usize)
                .map_or(0, |e| e.load(Ordering::Acquire)),
            None => 0,
        }
    }

    /// Whether the chunk holding `extent` was ever touched (if not, all its entries are holes).
    pub(crate) fn chunk_exists(&self, extent: u64) -> bool {
        let chunk = (extent / CHUNK_EXTENTS) as usize;
        self.chunks.get(chunk).and_then(OnceLock::get).is_some()
    }

    /// The entry slot of `extent`, creating its chunk; `None` past the end.
    pub(crate) fn slot(&self, extent: u64) -> Option<&AtomicU64> {
        if extent >= self.extent_count {
            return None;
        }
        let chunk = self.chunks.get((extent / CHUNK_EXTENTS) as usize)?;
        chunk
            .get_or_init(new_chunk)
            .get((extent % CHUNK_EXTENTS) as usize)
    }

    /// The entry slot of `extent` if its chunk exists.
    pub(crate) fn existing_slot(&self, extent: u64) -> Option<&AtomicU64> {
        if extent >= self.extent_count {
            return None;
        }
        self.chunks
            .get((extent / CHUNK_EXTENTS) as usize)?
            .get()?
            .get((extent % CHUNK_EXTENTS) as usize)
    }

    /// Changes the number of extents. The caller has released (zeroed) every entry past the
    /// new end before shrinking.
    pub(crate) fn resize(&mut self, extent_count: u64) {
        let chunks = extent_count.div_ceil(CHUNK_EXTENTS) as usize;
        self.chunks.truncate(chunks);
        while self.chunks.len() < chunks {
            self.chunks.push(OnceLock::new());
        }
        self.extent_count = extent_count;
    }

    /// Allocated entries with index in `[first, end)`, as (index, entry), skipping empty chunks.
    pub(crate) fn allocated_in(
        &self,
        first: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = end.min(self.extent_count);
        let mut idx = first;
        std::iter::from_fn(move || {
            while idx < end {
                if !self.chunk_exists(idx) {
                    idx = (idx / CHUNK_EXTENTS + 1) * CHUNK_EXTENTS;
                    continue;
                }
                let i = idx;
                idx += 1;
                let e = self.get(i);
                if e != 0 {
                    return Some((i, e));
                }
            }
            None
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_chunks_and_resize() {
        let mut m = ExtentMap::new(3000);
        assert_eq!(m.get(2999), 0);
        assert!(!m.chunk_exists(5));
        m.slot(2500).unwrap().store(42, Ordering::Release);
        assert!(m.chunk_exists(2048));
        assert!(!m.chunk_exists(5));
        assert_eq!(m.get(2500), 42);
        assert!(m.slot(3000).is_none());
        assert_eq!(
            m.allocated_in(0, 3000).collect::<Vec<_>>(),
            vec![(2500, 42)]
        );
        assert_eq!(m.allocated_in(0, 2500).count(), 0);
        m.slot(2500).unwrap().store(0, Ordering::Release);
        m.resize(1500);
        assert_eq!(m.extent_count(), 1500);
        assert!(m.slot(1500).is_none());
        m.resize(4000);
        assert_eq!(m.get(2500), 0);
        assert!(m.slot(3999).is_some());
    }
}
