//! Disk space held back for the metadata: a preallocated file beside `meta.redb`.
//!
//! Why: data writes fill a disk without asking; once the file system is full, a redb commit
//! fails with ENOSPC and nothing acknowledged can be made durable any more (a FLUSH fails, a
//! volume cannot be deleted to make room, a restart cannot even commit its open). The store
//! keeps `DATA_DIR/meta-reserve`, a file of `metadata_reserve_bytes` allocated blocks
//! (`fallocate`, so the blocks are really taken, not a sparse length). When a metadata commit
//! hits ENOSPC, the reserve is released (truncated to 0 and synced, which on ext4 and XFS
//! makes its blocks free once the journal commits) and the commit is retried on a reopened
//! database: the commit that hit the full disk and those after it go on in the freed space.
//! The reserve is taken again (`try_establish`) after a commit succeeds while there is room
//! for it plus as much again, so it comes back when the operator frees space.
//!
//! Rejected: preallocating `meta.redb` past its end (`FALLOC_FL_KEEP_SIZE`): redb shrinks its
//! file (`set_len`) when trailing regions are free, which frees the preallocation, and it
//! grows the file with `set_len` (a sparse extension), whose pages it later writes wherever
//! the file system puts them; the preallocation would be neither kept nor used.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::sync::lock;

/// Default `StoreConfig::metadata_reserve_bytes`: 64 MiB, room for tens of thousands of
/// commits of a busy pool (a commit rewrites a few 4 KiB pages, and redb reuses freed pages).
pub const DEFAULT_METADATA_RESERVE_BYTES: u64 = 64 << 20;

/// File name of the reserve in the data directory.
pub const RESERVE_FILE: &str = "meta-reserve";

/// The reserve file and whether it holds its blocks now.
#[derive(Debug)]
pub(crate) struct Reserve {
    path: PathBuf,
    size_bytes: u64,
    held: Mutex<bool>,
}

/// Whether an I/O error means the file system is full (ENOSPC, or EDQUOT for a quota).
pub(crate) fn is_no_space(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(c) if c == rustix::io::Errno::NOSPC.raw_os_error()
            || c == rustix::io::Errno::DQUOT.raw_os_error()
    ) || e.kind() == io::ErrorKind::StorageFull
}

impl Reserve {
    /// The reserve at `dir/meta-reserve` of `size_bytes` (0: none is kept). Takes it if it
    /// is not already taken; a full disk leaves it released (`is_held` false) rather than
    /// failing: the store must be able to start on a full disk.
    pub(crate) fn open(dir: &Path, size_bytes: u64) -> Reserve {
        let r = Reserve {
            path: dir.join(RESERVE_FILE),
            size_bytes,
            held: Mutex::new(false),
        };
        if size_bytes == 0 {
            // A reserve of an earlier configuration is given back.
            let _ = std::fs::remove_file(&r.path);
            return r;
        }
        let allocated = std::fs::metadata(&r.path)
            .map(|m| m.blocks().saturating_mul(512))
            .unwrap_or(0);
        if allocated >= size_bytes {
            *lock(&r.held) = true;
        } else {
            r.try_establish();
        }
        r
    }

    /// The configured size (0: no reserve).
    pub(crate) fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether the reserve holds its blocks (always true for a reserve of size 0).
    pub(crate) fn is_held(&self) -> bool {
        self.size_bytes == 0 || *lock(&self.held)
    }

    /// Frees the reserve's blocks for the metadata; true if it was held.
    pub(crate) fn release(&self) -> bool {
        let mut held = lock(&self.held);
        if self.size_bytes == 0 || !*held {
            return false;
        }
        match truncate_and_sync(&self.path) {
            Ok(()) => {
                *held = false;
                tracing::warn!(
                    path = %self.path.display(),
                    bytes = self.size_bytes,
                    "the disk is full: released the metadata reserve"
                );
                true
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "cannot release the metadata reserve");
                false
            }
        }
    }

    /// Takes the reserve again if the file system has room for it and as much again (so a
    /// nearly full disk is not pushed over by the reserve itself). True if held afterwards.
    pub(crate) fn try_establish(&self) -> bool {
        let mut held = lock(&self.held);
        if self.size_bytes == 0 || *held {
            return true;
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        match free_bytes(dir) {
            Ok(free) if free >= self.size_bytes.saturating_mul(2) => {}
            Ok(_) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the free space of the data directory");
                return false;
            }
        }
        match allocate(&self.path, self.size_bytes) {
            Ok(()) => {
                *held = true;
                tracing::info!(path = %self.path.display(), bytes = self.size_bytes, "metadata reserve taken");
                true
            }
            Err(e) => {
                // A partial allocation is given back: the reserve is all or nothing.
                let _ = truncate_and_sync(&self.path);
                tracing::warn!(path = %self.path.display(), error = %e, "cannot take the metadata reserve");
                false
            }
        }
    }
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

fn truncate_and_sync(path: &Path) -> io::Result<()> {
    let f = open_rw(path)?;
    f.set_len(0)?;
    f.sync_all()
}

fn allocate(path: &Path, size_bytes: u64) -> io::Result<()> {
    let f = open_rw(path)?;
    rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, size_bytes)?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Bytes an unprivileged writer may still allocate on the file system holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> io::Result<u64> {
    let s = rustix::fs::statvfs(dir)?;
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_allocated_released_and_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let r = Reserve::open(dir.path(), 1 << 20);
        assert!(r.is_held());
        let path = dir.path().join(RESERVE_FILE);
        let blocks = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
        assert!(blocks(&path) >= 1 << 20, "fallocate'd, not sparse");
        assert!(r.release());
        assert!(!r.is_held());
        assert_eq!(blocks(&path), 0);
        assert!(!r.release(), "released once");
        assert!(r.try_establish());
        assert!(blocks(&path) >= 1 << 20);
        // A reopen finds it held without allocating again.
        assert!(Reserve::open(dir.path(), 1 << 20).is_held());
        // Size 0: none, and the old file goes.
        let none = Reserve::open(dir.path(), 0);
        assert!(none.is_held() && !none.release());
        assert!(!path.exists());
    }

    #[test]
    fn no_space_is_enospc_or_edquot() {
        assert!(is_no_space(&io::Error::from_raw_os_error(
            rustix::io::Errno::NOSPC.raw_os_error()
        )));
        assert!(is_no_space(&io::Error::from_raw_os_error(
            rustix::io::Errno::DQUOT.raw_os_error()
        )));
        assert!(!is_no_space(&io::Error::from_raw_os_error(
            rustix::io::Errno::IO.raw_os_error()
        )));
    }
}
