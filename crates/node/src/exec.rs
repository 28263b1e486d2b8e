//! Block I/O execution off the async runtime.
//!
//! A read from a page-cached file takes microseconds, but a write into a new extent, a FLUSH or
//! a read from a cold disk can block for milliseconds; running those on a tokio worker would
//! stall every other session scheduled there. The executor is a small pool of OS threads (the
//! "workers" of docs/design.md) fed one request at a time (BurstCBS's 1-to-N mapping: a single
//! busy connection spreads over all workers instead of pinning one). Queues are unbounded here
//! because every submitter already holds an in-flight permit from its session; the sum of
//! those permits bounds what can be queued.
//!
//! **One queue, work-conserving.** The workers take requests from one FIFO, so a request
//! waits only while every worker is busy. (With one queue per worker, filled round robin, a
//! request landed behind whatever its worker was blocked on while another worker idled: a
//! neighbour's 20 ms device stall became this volume's p99.)
//!
//! **Stalls get a helper.** A request that blocks (a slow or failing disk, an `fdatasync`, an
//! injected latency spike) still holds its worker. When requests wait, no thread has taken or
//! finished one for [`STALL`], and every thread running a request is blocked in the kernel
//! (not runnable: `/proc/self/task/TID/stat`), a watchdog starts a helper thread (at most
//! [`MAX_HELPERS`] at once) that serves the queue and exits after [`HELPER_IDLE`] without
//! work. So a blocked device delays its own requests, not every volume's. Threads that are
//! merely waiting for a CPU do not count as stalled: a first version judged by time alone and
//! started helpers on a busy 2-core machine, which cost a third of the 4 KiB IOPS.
//!
//! **Lanes.** A node runs three executors ([`Lane`]): reads and writes; syncs (FLUSH and FUA
//! requests, which block in `fdatasync`); and bulk work (CACHE's readahead, WRITE_ZEROES,
//! TRIM, BLOCK_STATUS's walks), whose threads run at a lower CPU priority (nice
//! [`BULK_NICE`]). One FIFO for all of them let a neighbour's two CACHE or zeroing pieces
//! take both workers of the default pool, busy on the CPU (so no helper came), and a 4 KiB
//! read of another volume queued behind them for milliseconds (docs/results.md, "Lanes").
//! Apart, a read waits only for reads and writes; the kernel gives a bulk thread the CPU a
//! latency-bound thread leaves (nice 10 weighs about a tenth of nice 0), so bulk work still
//! runs at full speed on an idle machine.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::sync::lock;

/// A unit of blocking work; it delivers its own result (typically to a session's reply queue).
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// How long the queue may make no progress (no job taken or finished while jobs wait)
/// before a helper thread starts.
pub const STALL: Duration = Duration::from_millis(1);
/// Most helper threads alive at once (beyond them, stalled requests wait as before).
pub const MAX_HELPERS: usize = 16;
/// A helper exits after this long without work.
pub const HELPER_IDLE: Duration = Duration::from_millis(100);
/// The nice value of the bulk lane's threads (the others keep the process's).
pub const BULK_NICE: i32 = 10;

/// Which work an executor runs: its threads' names and CPU priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// READ and WRITE.
    Data,
    /// FLUSH and FUA requests.
    Sync,
    /// CACHE, WRITE_ZEROES, TRIM and BLOCK_STATUS, at nice [`BULK_NICE`].
    Bulk,
}

impl Lane {
    /// The prefix of its threads' names (`headroom-io-0`, `headroom-sync-help`, ...).
    pub fn thread_prefix(self) -> &'static str {
        match self {
            Lane::Data => "headroom-io",
            Lane::Sync => "headroom-sync",
            Lane::Bulk => "headroom-bulk",
        }
    }

    /// The nice value its threads set for themselves; 0 keeps the process's.
    pub fn nice(self) -> i32 {
        match self {
            Lane::Bulk => BULK_NICE,
            Lane::Data | Lane::Sync => 0,
        }
    }
}

/// How jobs run.
#[derive(Debug)]
pub struct Executor {
    pool: Arc<Pool>,
    worker_count: usize,
}

#[derive(Debug)]
struct Pool {
    lane: Lane,
    state: Mutex<State>,
    /// Threads wait here for jobs.
    work: Condvar,
    /// The watchdog waits here for jobs that find no idle thread.
    stalled: Condvar,
    /// Origin of `State::last_progress_ns`.
    epoch: Instant,
    helpers_started: AtomicU64,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads waiting for a job that no submitter has claimed.
    idle: usize,
    /// Waiting threads a submitter has woken for its job (not yet running).
    claimed: usize,
    /// Helper threads alive.
    helpers: usize,
    /// Helpers spawned that have not begun to serve yet.
    starting: usize,
    /// The watchdog sleeps until a job finds no thread.
    watch_parked: bool,
    /// Ns since `epoch` when a thread last took or finished a job, or the queue last
    /// stopped being empty (from then on its jobs wait).
    last_progress_ns: u64,
    /// Kernel thread ids of the threads running a job.
    busy: Vec<i32>,
    stopped: bool,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("queued", &self.queue.len())
            .field("idle", &self.idle)
            .field("helpers", &self.helpers)
            .field("stopped", &self.stopped)
            .finish_non_exhaustive()
    }
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Runs jobs until stopped (a worker) or idle for `HELPER_IDLE` (a helper).
    fn serve(self: &Arc<Self>, helper: bool) {
        let tid = rustix::thread::gettid().as_raw_nonzero().get();
        if self.lane.nice() != 0 {
            // Per thread on Linux: only this one runs at the lane's priority. Raising the nice
            // value needs no privilege; should it fail, the thread runs at the process's.
            if let Err(err) = rustix::process::setpriority_process(
                rustix::process::Pid::from_raw(tid),
                self.lane.nice(),
            ) {
                tracing::warn!(lane = ?self.lane, "could not lower an I/O thread's priority: {err}");
            }
        }
        let mut state = self.lock();
        loop {
            if let Some(job) = state.queue.pop_front() {
                state.last_progress_ns = self.now_ns();
                state.busy.push(tid);
                drop(state);
                // A panicking job must not take its thread (and the jobs behind it) down.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    tracing::error!("an I/O job panicked; its request gets no reply");
                }
                state = self.lock();
                state.last_progress_ns = self.now_ns();
                if let Some(i) = state.busy.iter().position(|&t| t == tid) {
                    state.busy.swap_remove(i);
                }
                continue;
            }
            if state.stopped {
                break;
            }
            // Wait until a submitter claims a waiting thread (any one: claims are
            // interchangeable), the pool stops, or a helper has idled long enough.
            state.idle += 1;
            let retire = loop {
                if state.claimed > 0 {
                    state.claimed -= 1;
                    break false;
                }
                if state.stopped {
                    state.idle -= 1;
                    break false;
                }
                if helper {
                    let (guard, timeout) = self
                        .work
                        .wait_timeout(state, HELPER_IDLE)
                        .unwrap_or_else(PoisonError::into_inner);
                    state = guard;
                    if timeout.timed_out() && state.claimed == 0 {
                        state.idle -= 1;
                        break true;
                    }
                } else {
                    state = self
                        .work
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            if retire && state.queue.is_empty() {
                break;
            }
        }
        if helper {
            state.helpers -= 1;
        }
    }

    /// The watchdog: starts a helper when a job waits with no thread coming for it and
    /// nothing has progressed for `STALL`. It sleeps while every queued job has a thread
    /// coming, and looks again at least every `STALL` otherwise.
    fn watch(self: &Arc<Self>) {
        let stall_ns = u64::try_from(STALL.as_nanos()).unwrap_or(u64::MAX);
        let mut state = self.lock();
        loop {
            if state.stopped {
                return;
            }
            let coming = state.claimed + state.starting;
            if state.queue.len() <= coming {
                state.watch_parked = true;
                state = self
                    .stalled
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
                state.watch_parked = false;
                continue;
            }
            let quiet_ns = self.now_ns().saturating_sub(state.last_progress_ns);
            // Stalled: nothing progressed for STALL, no woken thread is on its way, and every
            // thread running a job is blocked (runnable threads are making progress, or will
            // once they get a CPU).
            let stalled = quiet_ns >= stall_ns
                && state.helpers < MAX_HELPERS
                && state.claimed == 0
                && !state.busy.is_empty()
                && {
                    let busy = state.busy.clone();
                    drop(state);
                    let blocked = busy.iter().all(|&tid| !thread_runnable(tid));
                    state = self.lock();
                    blocked
                };
            if !stalled {
                let wait_ns = stall_ns.saturating_sub(quiet_ns).max(stall_ns / 4);
                state = self
                    .stalled
                    .wait_timeout(state, Duration::from_nanos(wait_ns))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            if state.stopped || state.queue.len() <= state.claimed + state.starting {
                continue;
            }
            state.helpers += 1;
            state.starting += 1;
            drop(state);
            let pool = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name(format!("{}-help", self.lane.thread_prefix()))
                .spawn(move || {
                    pool.lock().starting -= 1;
                    pool.serve(true);
                });
            state = self.lock();
            match spawned {
                Ok(_) => {
                    let n = self.helpers_started.fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::debug!(
                        helpers = state.helpers,
                        started = n,
                        "I/O workers stalled: helper started"
                    );
                }
                Err(err) => {
                    state.helpers -= 1;
                    state.starting -= 1;
                    tracing::warn!("I/O workers stalled and no helper thread could start: {err}");
                }
            }
        }
    }
}

/// Whether thread `tid` of this process is running or waiting for a CPU (state `R` in
/// `/proc/self/task/TID/stat`). Unknown (no procfs): not runnable, so stalls are judged by
/// time alone.
fn thread_runnable(tid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
        return false;
    };
    // "TID (COMM) STATE ...": COMM may hold spaces and parentheses; the state follows the
    // last ')'.
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next())
        == Some('R')
}

impl Executor {
    /// Starts `worker_count` threads (at least one) of the data lane and the watchdog. They
    /// exit when the last `Executor` handle is dropped and the queue is drained.
    pub fn start(worker_count: usize) -> std::io::Result<Arc<Executor>> {
        Self::start_lane(worker_count, Lane::Data)
    }

    /// As [`Executor::start`], for `lane`: its threads' names and priority.
    pub fn start_lane(worker_count: usize, lane: Lane) -> std::io::Result<Arc<Executor>> {
        let worker_count = worker_count.max(1);
        let pool = Arc::new(Pool {
            lane,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            stalled: Condvar::new(),
            epoch: Instant::now(),
            helpers_started: AtomicU64::new(0),
        });
        let executor = Arc::new(Executor {
            pool: Arc::clone(&pool),
            worker_count,
        });
        for worker_index in 0..worker_count {
            let pool = Arc::clone(&pool);
            std::thread::Builder::new()
                .name(format!("{}-{worker_index}", lane.thread_prefix()))
                .spawn(move || pool.serve(false))?;
        }
        let watchdog = Arc::clone(&pool);
        std::thread::Builder::new()
            .name(format!("{}-watch", lane.thread_prefix()))
            .spawn(move || watchdog.watch())?;
        Ok(executor)
    }

    /// Queues a job. Returns the job back if the pool has stopped.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        let mut state = self.pool.lock();
        if state.stopped {
            return Err(job);
        }
        if state.queue.is_empty() {
            state.last_progress_ns = self.pool.now_ns();
        }
        state.queue.push_back(job);
        if state.idle > 0 {
            state.idle -= 1;
            state.claimed += 1;
            self.pool.work.notify_one();
        } else if state.watch_parked {
            // No thread is free for this job: the watchdog keeps an eye on it.
            state.watch_parked = false;
            self.pool.stalled.notify_one();
        }
        Ok(())
    }

    /// Number of worker threads (helpers not counted).
    pub fn worker_count(&self) -> usize {
        self.worker_count
    }

    /// Helper threads started since the start (diagnostics).
    pub fn helpers_started(&self) -> u64 {
        self.pool.helpers_started.load(Ordering::Relaxed)
    }
}

/// The node's three executors, one per [`Lane`].
#[derive(Debug)]
pub struct Lanes {
    data: Arc<Executor>,
    sync: Arc<Executor>,
    bulk: Arc<Executor>,
}

impl Lanes {
    /// Starts every lane with `workers_per_lane` threads (at least one).
    pub fn start(workers_per_lane: usize) -> std::io::Result<Lanes> {
        Ok(Lanes {
            data: Executor::start_lane(workers_per_lane, Lane::Data)?,
            sync: Executor::start_lane(workers_per_lane, Lane::Sync)?,
            bulk: Executor::start_lane(workers_per_lane, Lane::Bulk)?,
        })
    }

    /// The executor of `lane`.
    pub fn get(&self, lane: Lane) -> &Arc<Executor> {
        match lane {
            Lane::Data => &self.data,
            Lane::Sync => &self.sync,
            Lane::Bulk => &self.bulk,
        }
    }
}

impl Drop for Executor {
    /// Stops the threads once the queue is drained.
    fn drop(&mut self) {
        self.pool.lock().stopped = true;
        self.pool.work.notify_all();
        self.pool.stalled.notify_all();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::mpsc;

    /// The name and nice value of the thread that runs a job on `executor`.
    fn where_a_job_runs(executor: &Executor) -> (String, i32) {
        let (tx, rx) = mpsc::channel();
        executor
            .submit(Box::new(move || {
                let name = std::thread::current().name().unwrap_or("").to_string();
                let nice = rustix::process::getpriority_process(None).unwrap();
                tx.send((name, nice)).unwrap();
            }))
            .map_err(|_| "stopped")
            .unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    #[test]
    fn each_lane_runs_on_its_own_threads_and_bulk_work_at_a_lower_priority() {
        let process_nice = rustix::process::getpriority_process(None).unwrap();
        let lanes = Lanes::start(1).unwrap();
        let (data, data_nice) = where_a_job_runs(lanes.get(Lane::Data));
        let (sync, sync_nice) = where_a_job_runs(lanes.get(Lane::Sync));
        let (bulk, bulk_nice) = where_a_job_runs(lanes.get(Lane::Bulk));
        assert_eq!(
            (data.as_str(), sync.as_str(), bulk.as_str()),
            ("headroom-io-0", "headroom-sync-0", "headroom-bulk-0")
        );
        assert_eq!((data_nice, sync_nice), (process_nice, process_nice));
        // Nice values stop at 19.
        assert_eq!(bulk_nice, (process_nice + BULK_NICE).min(19));
        assert!(bulk_nice > process_nice || process_nice == 19);

        // A bulk job that never ends holds its lane only: the data lane still runs jobs.
        let (release, blocked) = mpsc::channel::<()>();
        lanes
            .get(Lane::Bulk)
            .submit(Box::new(move || {
                let _ = blocked.recv();
            }))
            .map_err(|_| "stopped")
            .unwrap();
        assert_eq!(where_a_job_runs(lanes.get(Lane::Data)).0, "headroom-io-0");
        release.send(()).unwrap();
    }

    #[test]
    fn one_worker_runs_jobs_in_order_and_drains_at_drop() {
        let exec = Executor::start(1).unwrap();
        let (tx, rx) = mpsc::channel();
        for i in 0..100 {
            let tx = tx.clone();
            assert!(exec.submit(Box::new(move || tx.send(i).unwrap())).is_ok());
        }
        drop(exec);
        let got: Vec<i32> = (0..100)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_job_is_not_stuck_behind_jobs_that_block_every_worker() {
        let exec = Executor::start(2).unwrap();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (started_tx, started_rx) = mpsc::channel();
        // Four jobs that block until released: two hold the workers, two wait in the queue.
        for _ in 0..4 {
            let (release, started) = (Arc::clone(&release_rx), started_tx.clone());
            let job = exec.submit(Box::new(move || {
                started.send(()).unwrap();
                let _ = release.lock().unwrap().recv();
            }));
            assert!(job.is_ok());
        }
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let (done_tx, done_rx) = mpsc::channel();
        let submitted = Instant::now();
        assert!(
            exec.submit(Box::new(move || done_tx.send(()).unwrap()))
                .is_ok()
        );
        // Helpers take the two queued blockers, then one more takes this job.
        done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let waited = submitted.elapsed();
        assert!(exec.helpers_started() >= 1);
        for _ in 0..4 {
            release_tx.send(()).unwrap();
        }
        eprintln!(
            "waited {waited:?} behind blocked workers; {} helpers",
            exec.helpers_started()
        );
    }

    #[test]
    fn threads_are_runnable_or_not() {
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        assert!(thread_runnable(me), "the calling thread is running");
        let (tx, rx) = mpsc::channel::<i32>();
        let (hold, wait) = mpsc::channel::<()>();
        let sleeper = std::thread::spawn(move || {
            tx.send(rustix::thread::gettid().as_raw_nonzero().get())
                .unwrap();
            let _ = wait.recv();
        });
        let tid = rx.recv().unwrap();
        // Poll (bounded) until the thread has gone to sleep in recv.
        let deadline = Instant::now() + Duration::from_secs(10);
        while thread_runnable(tid) {
            assert!(Instant::now() < deadline, "thread {tid} never slept");
            std::thread::yield_now();
        }
        drop(hold);
        sleeper.join().unwrap();
        assert!(!thread_runnable(i32::MAX), "no such thread");
    }

    #[test]
    fn a_panicking_job_does_not_take_the_worker_down() {
        let exec = Executor::start(1).unwrap();
        assert!(exec.submit(Box::new(|| panic!("test panic"))).is_ok());
        let (tx, rx) = mpsc::channel();
        assert!(exec.submit(Box::new(move || tx.send(7).unwrap())).is_ok());
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), 7);
    }

    #[test]
    fn a_stopped_executor_returns_the_job() {
        let exec = Executor::start(1).unwrap();
        exec.pool.lock().stopped = true;
        assert!(exec.submit(Box::new(|| {})).is_err());
    }
}
