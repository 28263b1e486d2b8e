//! Deliberate bugs in the commit protocol and the checksums' write-intent bitmap, for the power-cut test to prove it catches them
//! (`tests/power_cut.rs`).
//!
//! Why: a durability test that passes is only worth something if it fails when durability
//! is broken. With the cargo feature `mutants` (enabled by this crate's own dev-dependency
//! on itself, so only test builds have it) a test may switch one mutant on for its thread;
//! the store runs the mutated protocol on that thread only, so tests running beside it are
//! unaffected. Without the feature `active` is a constant `false` and costs nothing.

/// A known-wrong variant of `Shared::commit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// Commit the metadata without syncing the devices first.
    SkipDeviceSync,
    /// Commit the metadata first and sync the devices after it.
    SyncAfterCommit,
    /// Set a checksummed device's write-intent bit in memory only, never durably before the
    /// data write (`checksum.rs`): after a power cut, torn blocks are not recomputed.
    SkipBitmapWrite,
}

#[cfg(feature = "mutants")]
thread_local! {
    static ACTIVE: std::cell::Cell<Option<Mutant>> = const { std::cell::Cell::new(None) };
}

/// Switches `mutant` on (or, with `None`, every mutant off) for the calling thread.
#[cfg(feature = "mutants")]
pub fn set(mutant: Option<Mutant>) {
    ACTIVE.with(|a| a.set(mutant));
}

/// Whether `mutant` is on for the calling thread.
#[inline]
pub(crate) fn active(mutant: Mutant) -> bool {
    #[cfg(feature = "mutants")]
    {
        ACTIVE.with(|a| a.get() == Some(mutant))
    }
    #[cfg(not(feature = "mutants"))]
    {
        let _ = mutant;
        false
    }
}
