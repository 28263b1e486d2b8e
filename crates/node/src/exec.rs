//! Block I/O execution off the async runtime.
//!
//! A read from a page-cached file takes microseconds, but a write into a new extent, a FLUSH or
//! a read from a cold disk can block for milliseconds; running those on a tokio worker would
//! stall every other session scheduled there. The executor is a small pool of OS threads (the
//! "workers" of docs/design.md) fed one request at a time and sprayed round-robin (BurstCBS's 1-to-N
//! mapping: a single busy connection spreads over all workers instead of pinning one). Queues are
//! unbounded here because every submitter already holds an in-flight permit from its session;
//! the sum of those permits bounds what can be queued.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

/// A unit of blocking work; it delivers its own result (typically to a session's reply queue).
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// How jobs run.
#[derive(Debug)]
pub struct Executor {
    senders: Vec<mpsc::Sender<Job>>,
    next_worker: AtomicUsize,
}

impl Executor {
    /// Starts `worker_count` threads (at least one). They exit when the last `Executor` handle
    /// is dropped and their queues are drained.
    pub fn start(worker_count: usize) -> std::io::Result<Arc<Executor>> {
        let worker_count = worker_count.max(1);
        let mut senders = Vec::with_capacity(worker_count);
        for worker_index in 0..worker_count {
            let (sender, receiver) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("headroom-io-{worker_index}"))
                .spawn(move || {
                    while let Ok(job) = receiver.recv() {
                        job();
                    }
                })?;
            senders.push(sender);
        }
        Ok(Arc::new(Executor {
            senders,
            next_worker: AtomicUsize::new(0),
        }))
    }

    /// Queues a job on the next worker. Returns the job back if the pool has stopped.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        let index = self.next_worker.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        self.senders[index].send(job).map_err(|err| err.0)
    }

    /// Number of worker threads.
    pub fn worker_count(&self) -> usize {
        self.senders.len()
    }
}
