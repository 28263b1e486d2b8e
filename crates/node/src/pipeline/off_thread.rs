//! The pipeline's work handed to threads off the runtime (the executor lanes, tokio's
//! blocking pool), counted until each task is gone, captures and all.
//!
//! Why: such a task delivers its reply and only then lets go of what it holds (the job's
//! volume, the store under it). A stop that returned once every client had its replies
//! could leave the store open behind it for a moment, and a node started again on the same
//! data in that moment found its database still open (`DatabaseAlreadyOpen`). The node's
//! stop waits for the count to reach zero before it flushes and returns
//! (`crates/node/src/server/shutdown.rs`).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::sync::lock;

/// Tasks handed off and not yet gone.
#[derive(Debug, Default)]
pub struct OffThreadWork {
    count: Mutex<u64>,
    idle: Condvar,
}

/// Held by a task until it is gone.
#[derive(Debug)]
struct Counted(Arc<OffThreadWork>);

impl Drop for Counted {
    fn drop(&mut self) {
        let mut count = lock(&self.0.count);
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.0.idle.notify_all();
        }
    }
}

impl OffThreadWork {
    /// `task`, counted from now until it has run and dropped what it captured (or was
    /// dropped unrun).
    pub fn counted(
        self: &Arc<Self>,
        task: impl FnOnce() + Send + 'static,
    ) -> impl FnOnce() + Send + 'static {
        *lock(&self.count) += 1;
        let counted = Counted(Arc::clone(self));
        move || {
            task();
            drop(counted);
        }
    }

    /// Waits until no counted task is left, at most `limit`; whether none is.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let count = lock(&self.count);
        let (count, _) = self
            .idle
            .wait_timeout_while(count, limit, |n| *n > 0)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *count == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_counts_until_it_and_its_captures_are_gone() {
        let work = Arc::new(OffThreadWork::default());
        let held = Arc::new(());
        let capture = Arc::clone(&held);
        let task = work.counted(move || {
            let _ = &capture;
        });
        assert!(!work.wait_idle(Duration::ZERO), "counted before it runs");
        let ran = std::thread::spawn(task);
        assert!(work.wait_idle(Duration::from_secs(30)));
        ran.join().unwrap();
        assert_eq!(Arc::strong_count(&held), 1, "its capture is gone");
        // Dropped unrun: no longer counted either.
        drop(work.counted(|| {}));
        assert!(work.wait_idle(Duration::ZERO));
    }
}
