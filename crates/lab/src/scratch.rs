//! A scratch directory for one server's files (configuration, data, log, images), removed
//! when dropped.
//!
//! Why: a row leaves nothing behind, whichever way it ends; each directory's name carries the
//! PID and a counter, so concurrent runs and rows never share one.

use std::path::{Path, PathBuf};

use crate::error::RunError;

/// A scratch directory for one server, removed when dropped.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch, RunError> {
        Self::under(&std::env::temp_dir(), tag)
    }

    /// A scratch directory under `base` (e.g. /dev/shm for images that must be in RAM).
    pub fn under(base: &Path, tag: &str) -> Result<Scratch, RunError> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = base.join(format!("headroom-lab-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(RunError::io(format!("creating {}", dir.display())))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
