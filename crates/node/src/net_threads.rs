//! Network threads that own their connections: each NBD connection runs, start to end, on one
//! thread of its own single-threaded runtime, picked at accept time.
//!
//! Why: a connection is two tasks, the reader (which parses requests and runs the small ones
//! inline) and the writer (which sends the replies). On tokio's shared multi-thread runtime
//! they land on different worker threads, so every batch of replies is a cross-thread wake-up
//! (a futex and, on a VM, an inter-processor interrupt), and the worker that parks waits to be
//! woken again by the other. On one thread the reader's wake of the writer is a push on a
//! local queue and the writer runs when the reader yields, which is the shape of the cheapest
//! server there is (`floor_server`, docs/results.md "The floor"). Measured on 4 KiB QD32 reads
//! and writes of a RAM volume: 0.63–0.65× the CPU per I/O of the shared runtime and 1.48–1.54×
//! its IOPS when waking another CPU is dear on the VM, no difference when it is cheap
//! (docs/results.md, "Network threads that own their connections").
//!
//! Several connections spread over the threads: a new one goes to the thread with the fewest
//! open connections (ties to the lowest index), as BurstCBS spreads volumes over its
//! threads. There is no stealing: a thread busy with one heavy connection keeps it, which is
//! the price of the locality; an operator with one busy client per core sets as many threads
//! as cores. `[server] net_threads = 0` keeps the shared runtime (the layout before).
//!
//! The queues of vhost-user-blk attachments live here too, each queue's submitter and
//! completer on one thread (decision 73), for the same reason.
//!
//! Only the connections (and queues) live here. Everything else (the API, the sampler, the
//! accept loop, blocking work) stays on the process's runtime; a session's blocking work goes
//! there through its `IoRuntime` handle as before. When the `NetThreads` is dropped the
//! threads stop taking connections, drop the ones they have (as the end of the process
//! would) and end; a stopping node waits for that with the [`ThreadsEnded`] taken at start (on a
//! blocking thread), so the connections' hold on the store is gone before it is flushed and
//! closed, and a node started again on the same data at once finds it free.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc;

/// A connection's work, built on its thread (so its socket registers with that thread's
/// reactor) and spawned there.
type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Most threads an operator may ask for.
pub const MAX_NET_THREADS: usize = 256;

/// Open connections per thread, in thread order: shared with whoever reports them
/// (`GET /v1/connections`).
#[derive(Clone, Debug, Default)]
pub struct OpenConnections(Arc<[AtomicUsize]>);

impl OpenConnections {
    /// The counts now, in thread order (empty: connections share the runtime).
    pub fn per_thread(&self) -> Vec<usize> {
        self.0.iter().map(|n| n.load(Ordering::Relaxed)).collect()
    }
}

/// The threads, and where each takes new connections.
pub struct NetThreads {
    jobs: Vec<mpsc::UnboundedSender<Job>>,
    open: OpenConnections,
}

/// Says when every thread of a [`NetThreads`] has ended, its connections dropped: each
/// thread holds a sender of `done` until its runtime is gone.
#[derive(Debug)]
pub struct ThreadsEnded {
    done: std::sync::mpsc::Receiver<()>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl ThreadsEnded {
    /// Blocks until every thread has ended, at most `limit`; whether they all did. Call it
    /// after the `NetThreads` is dropped (they end only then).
    pub fn wait(self, limit: std::time::Duration) -> bool {
        match self.done.recv_timeout(limit) {
            // Nothing is ever sent: every sender gone is every thread done.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) | Ok(()) => {
                for thread in self.threads {
                    let _ = thread.join();
                }
                true
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => false,
        }
    }
}

impl std::fmt::Debug for NetThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetThreads")
            .field("threads", &self.jobs.len())
            .field("open", &self.open.per_thread())
            .finish()
    }
}

/// Decrements its thread's count of open connections when the connection ends, however.
struct OpenGuard(OpenConnections, usize);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.0[self.1].fetch_sub(1, Ordering::Relaxed);
    }
}

impl NetThreads {
    /// Starts `count` threads (at least one, at most [`MAX_NET_THREADS`]), each running a
    /// single-threaded runtime with the reply coalescing hooks of the process's runtime;
    /// with them, what says when they have ended.
    pub fn start(count: usize) -> std::io::Result<(Self, ThreadsEnded)> {
        let count = count.clamp(1, MAX_NET_THREADS);
        let mut senders = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        let (done, ended) = std::sync::mpsc::channel::<()>();
        for index in 0..count {
            let done = done.clone();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .on_thread_park(crate::coalesce::on_worker_park)
                .on_thread_unpark(crate::coalesce::on_worker_unpark)
                .build()?;
            let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
            let thread = std::thread::Builder::new()
                .name(format!("headroom-conn-{index}"))
                .spawn(move || {
                    crate::coalesce::on_worker_start();
                    runtime.block_on(async move {
                        while let Some(job) = rx.recv().await {
                            tokio::spawn(job());
                        }
                    });
                    // The runtime drops here, on its own thread, with the connections left;
                    // then `done`, which tells `ThreadsEnded`.
                    drop(runtime);
                    drop(done);
                })?;
            senders.push(jobs);
            threads.push(thread);
        }
        let open = OpenConnections((0..count).map(|_| AtomicUsize::new(0)).collect());
        let threads_ended = ThreadsEnded {
            done: ended,
            threads,
        };
        Ok((
            NetThreads {
                jobs: senders,
                open,
            },
            threads_ended,
        ))
    }

    /// How many threads there are.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether there are none (never, once started).
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The open connections per thread, live, for reports.
    pub fn open_connections(&self) -> OpenConnections {
        self.open.clone()
    }

    /// Runs a connection on the thread with the fewest open ones: `make` is called there and
    /// its future spawned there. Returns the thread's index, or `None` if that thread has
    /// ended (only a runtime that itself panicked does; the connection is then dropped).
    pub fn spawn<F, Fut>(&self, make: F) -> Option<usize>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let open = &self.open.0;
        let index = (0..open.len()).min_by_key(|&i| (open[i].load(Ordering::Relaxed), i))?;
        open[index].fetch_add(1, Ordering::Relaxed);
        let guard = OpenGuard(self.open.clone(), index);
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let _guard = guard;
                make().await;
            })
        });
        // A refused job is dropped with its guard, which takes the count back.
        self.jobs[index].send(job).ok().map(|()| index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    #[test]
    fn a_connection_runs_start_to_end_on_one_thread() {
        let (threads, _) = NetThreads::start(2).unwrap();
        let (tx, rx) = std_mpsc::channel();
        let placed = threads
            .spawn(move || async move {
                let before = std::thread::current().name().map(str::to_owned);
                // A spawned task (the session's writer) and a timer stay on the same thread.
                let inner =
                    tokio::spawn(async { std::thread::current().name().map(str::to_owned) });
                tokio::time::sleep(Duration::from_millis(1)).await;
                let spawned = inner.await.unwrap();
                let after = std::thread::current().name().map(str::to_owned);
                tx.send((before, spawned, after)).unwrap();
            })
            .expect("a thread took it");
        let (before, spawned, after) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let want = Some(format!("headroom-conn-{placed}"));
        assert_eq!(before, want);
        assert_eq!(spawned, want);
        assert_eq!(after, want);
    }

    /// Once the threads are told to end, `ThreadsEnded::wait` returns only after every
    /// connection they held is dropped (here one whose drop takes a while, as a session
    /// letting go of its volume may): what a stopping node relies on before it closes the
    /// store.
    #[test]
    fn the_threads_have_dropped_their_connections_when_wait_returns() {
        struct SlowDrop {
            _held: std::sync::Arc<()>,
        }
        impl Drop for SlowDrop {
            fn drop(&mut self) {
                // Work done while letting go, not a wait for anything.
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let (threads, ended) = NetThreads::start(2).unwrap();
        let held = std::sync::Arc::new(());
        let (started, running) = std_mpsc::channel();
        let slow = SlowDrop {
            _held: std::sync::Arc::clone(&held),
        };
        threads
            .spawn(move || async move {
                let _slow = slow;
                started.send(()).unwrap();
                std::future::pending::<()>().await;
            })
            .expect("a thread took it");
        running.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(std::sync::Arc::strong_count(&held), 2);
        drop(threads);
        assert!(ended.wait(Duration::from_secs(10)), "the threads ended");
        assert_eq!(
            std::sync::Arc::strong_count(&held),
            1,
            "the connection was dropped before wait returned"
        );
    }

    #[test]
    fn new_connections_go_to_the_thread_with_the_fewest() {
        let (threads, _) = NetThreads::start(3).unwrap();
        let mut holds = Vec::new();
        let mut placed = Vec::new();
        for _ in 0..6 {
            let (hold_tx, hold_rx) = tokio::sync::oneshot::channel::<()>();
            holds.push(hold_tx);
            let index = threads
                .spawn(move || async move {
                    let _ = hold_rx.await;
                })
                .expect("a thread took it");
            placed.push(index);
        }
        // Counted at spawn time, so the spread does not depend on when the threads run.
        assert_eq!(placed, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(threads.open_connections().per_thread(), vec![2, 2, 2]);
        // Ending the connections of thread 1 makes it the emptiest.
        drop(holds.remove(4));
        drop(holds.remove(1));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while threads.open_connections().per_thread() != vec![2, 0, 2] {
            assert!(std::time::Instant::now() < deadline, "{threads:?}");
            std::thread::yield_now();
        }
        let (hold_tx, hold_rx) = tokio::sync::oneshot::channel::<()>();
        let index = threads
            .spawn(move || async move {
                let _ = hold_rx.await;
            })
            .expect("a thread took it");
        assert_eq!(index, 1);
        drop(hold_tx);
        drop(holds);
    }

    #[test]
    fn the_thread_count_is_bounded() {
        assert_eq!(NetThreads::start(0).unwrap().0.len(), 1);
    }
}
