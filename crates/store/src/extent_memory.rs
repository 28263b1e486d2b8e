//! The memory behind one RAM extent, on a transparent huge page where the kernel allows it.
//!
//! A 4 KiB random read from a RAM volume is a 4 KiB copy out of a 2 MiB extent. With the
//! extent on 4 KiB pages, nearly every such read misses the TLB, and on a virtual machine a
//! miss walks two page tables (guest and host): profiling `serve --memory` under 4 KiB random
//! reads put a third of the server's CPU time in that one `memcpy` (docs/results.md, issue 13).
//! An extent is exactly one huge page (2 MiB), so each is mapped on its own, aligned to 2 MiB
//! and marked `MADV_HUGEPAGE`: the kernel then backs it with one huge page at the first
//! write (it arrives zeroed, like the old `calloc`), and a read costs one TLB entry per extent.
//!
//! The mapping is 4 MiB of address space (only the aligned 2 MiB inside it is ever touched, so
//! only that is backed). Each mapping is a few kernel VMAs, and a process may hold at most
//! `vm.max_map_count` (65,530 by default): past [`MAPPED_EXTENTS_MAX`] extents alive at once,
//! new ones come from the heap as before, which works everywhere and only costs the TLB.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use memmap2::{Advice, MmapMut};

use crate::layout::EXTENT_SIZE_BYTES;

const EXTENT_BYTES: usize = EXTENT_SIZE_BYTES as usize;
/// Huge-page-mapped extents alive at once in this process (32 GiB of RAM extents).
pub const MAPPED_EXTENTS_MAX: usize = 16 << 10;

static MAPPED_EXTENTS: AtomicUsize = AtomicUsize::new(0);

/// One extent's bytes, zeroed when created.
#[derive(Debug)]
pub(crate) enum ExtentMemory {
    /// A private anonymous mapping; the extent is `EXTENT_BYTES` from `offset`, 2 MiB aligned.
    Mapped {
        map: MmapMut,
        offset: usize,
    },
    Heap(Box<[u8]>),
}

impl ExtentMemory {
    /// A zeroed extent: a huge-page mapping while the process holds fewer than
    /// [`MAPPED_EXTENTS_MAX`] of them and the kernel grants one, else heap memory.
    pub(crate) fn zeroed() -> ExtentMemory {
        if MAPPED_EXTENTS.fetch_add(1, Ordering::Relaxed) < MAPPED_EXTENTS_MAX {
            match Self::mapped() {
                Ok(memory) => return memory,
                Err(err) => tracing::debug!(error = %err, "huge-page extent refused; using heap"),
            }
        }
        MAPPED_EXTENTS.fetch_sub(1, Ordering::Relaxed);
        ExtentMemory::Heap(vec![0u8; EXTENT_BYTES].into_boxed_slice())
    }

    fn mapped() -> io::Result<ExtentMemory> {
        let map = MmapMut::map_anon(2 * EXTENT_BYTES)?;
        let misalign = map.as_ptr() as usize % EXTENT_BYTES;
        let offset = if misalign == 0 {
            0
        } else {
            EXTENT_BYTES - misalign
        };
        // Advice only: a kernel without THP (or with it off) still gives a working mapping.
        if let Err(err) = map.advise_range(Advice::HugePage, offset, EXTENT_BYTES) {
            tracing::debug!(error = %err, "MADV_HUGEPAGE refused");
        }
        Ok(ExtentMemory::Mapped { map, offset })
    }
}

impl Drop for ExtentMemory {
    fn drop(&mut self) {
        if matches!(self, ExtentMemory::Mapped { .. }) {
            MAPPED_EXTENTS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl std::ops::Deref for ExtentMemory {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            ExtentMemory::Mapped { map, offset } => &map[*offset..*offset + EXTENT_BYTES],
            ExtentMemory::Heap(data) => data,
        }
    }
}

impl std::ops::DerefMut for ExtentMemory {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            ExtentMemory::Mapped { map, offset } => &mut map[*offset..*offset + EXTENT_BYTES],
            ExtentMemory::Heap(data) => data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_extent_is_zeroed_aligned_and_writable() {
        let mut extent = ExtentMemory::zeroed();
        assert_eq!(extent.len(), EXTENT_BYTES);
        assert!(extent.iter().all(|&b| b == 0));
        if let ExtentMemory::Mapped { .. } = extent {
            assert_eq!(extent.as_ptr() as usize % EXTENT_BYTES, 0);
        }
        extent[EXTENT_BYTES - 1] = 7;
        extent[0] = 9;
        assert_eq!((extent[0], extent[EXTENT_BYTES - 1]), (9, 7));
    }
}
