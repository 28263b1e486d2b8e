//! Reply coalescing: a network thread that is about to sleep waits a few microseconds first
//! when that lets it answer several requests per wake-up instead of one.
//!
//! Under a deep queue from a single client (fio at QD32), requests reach the server one
//! TCP segment at a time, as the client completes earlier ones. A server that answers each at
//! once wakes once per request: one `epoll_wait`, one `recv`, one `send` and a sleep/wake pair
//! each, which on this kind of VM cost more than the storage work (docs/results.md).
//! Waiting `coalesce_us` before parking lets the next few requests land in the socket; the
//! thread then reads them in one `recv`, runs them, and the session's writer sends all their
//! replies in one `send`. It is NIC interrupt moderation moved into the server, and it costs
//! no CPU: the thread sleeps.
//!
//! It is adaptive, per thread, so a client that waits for each reply (QD1) pays nothing:
//! - it waits only while the thread's recent idle gaps (park to wake-up, a moving average)
//!   are shorter than the wait itself, i.e. requests are arriving back to back;
//! - a wait after which the thread found fewer than two new requests bought nothing, so the
//!   thread stops waiting for a number of parks that doubles on each such miss (up to 256)
//!   and is reset by a wait that paid.
//!
//! Sessions report each request header they read with [`note_request`]. The delay is global
//! (`[server] coalesce_us`, set once at start); 0 turns the whole mechanism off.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The wait before parking, in ns; 0: never wait.
static DELAY_NS: AtomicU64 = AtomicU64::new(0);

/// Most parks skipped after waits that bought nothing.
const BACKOFF_MAX_PARKS: u32 = 256;

/// Sets the wait (`[server] coalesce_us`); 0 turns coalescing off.
pub fn set_delay_us(us: u64) {
    DELAY_NS.store(us.saturating_mul(1000), Ordering::Relaxed);
}

thread_local! {
    static STATE: Cell<ThreadState> = const { Cell::new(ThreadState::new()) };
    /// When this thread last parked (after any wait), if it is parked.
    static PARKED_AT: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// A session read a request header on this thread.
#[inline]
pub fn note_request() {
    STATE.with(|s| {
        let mut st = s.get();
        st.requests = st.requests.saturating_add(1);
        s.set(st);
    });
}

/// Called by the runtime on a worker thread at start: timers of this thread fire within
/// 1 µs of their deadline instead of the default 50 µs slack, so a 10 µs wait is 10 µs.
pub fn on_worker_start() {
    if let Err(err) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1000)) {
        tracing::debug!(error = %err, "timer slack unchanged");
    }
}

/// Called by the runtime when a worker thread is about to park (it has no task to run).
pub fn on_worker_park() {
    let delay_ns = DELAY_NS.load(Ordering::Relaxed);
    if delay_ns == 0 {
        return;
    }
    let mut st = STATE.with(Cell::get);
    let wait = st.before_park(delay_ns);
    STATE.with(|s| s.set(st));
    if wait {
        std::thread::sleep(Duration::from_nanos(delay_ns));
    }
    PARKED_AT.with(|p| p.set(Some(Instant::now())));
}

/// Called by the runtime when a worker thread wakes up.
pub fn on_worker_unpark() {
    let Some(parked_at) = PARKED_AT.with(Cell::take) else {
        return;
    };
    let idle_ns = u64::try_from(parked_at.elapsed().as_nanos()).unwrap_or(u64::MAX);
    STATE.with(|s| {
        let mut st = s.get();
        st.after_unpark(idle_ns);
        s.set(st);
    });
}

/// One thread's coalescing state; pure, so the rule is tested without threads or clocks.
#[derive(Clone, Copy, Debug)]
struct ThreadState {
    /// Requests read since the thread last woke.
    requests: u32,
    /// Moving average of the idle gap (park to wake-up), ns.
    idle_ns_avg: u64,
    /// Whether the thread waited before its last park.
    waited: bool,
    /// Parks left without waiting, and the length of the next such run.
    skip_parks: u32,
    backoff_parks: u32,
}

impl ThreadState {
    const fn new() -> ThreadState {
        ThreadState {
            requests: 0,
            // Starts idle: a thread waits only once it has seen back-to-back requests.
            idle_ns_avg: u64::MAX / 2,
            waited: false,
            skip_parks: 0,
            backoff_parks: 1,
        }
    }

    /// Decides whether to wait `delay_ns` before this park, and learns from the last one.
    fn before_park(&mut self, delay_ns: u64) -> bool {
        let requests = std::mem::take(&mut self.requests);
        if self.waited {
            if requests >= 2 {
                self.backoff_parks = 1;
            } else {
                self.skip_parks = self.backoff_parks;
                self.backoff_parks = (self.backoff_parks * 2).min(BACKOFF_MAX_PARKS);
            }
        }
        self.waited = if self.skip_parks > 0 {
            self.skip_parks -= 1;
            false
        } else {
            requests > 0 && self.idle_ns_avg < delay_ns
        };
        self.waited
    }

    fn after_unpark(&mut self, idle_ns: u64) {
        // An average over about eight gaps: quick to follow a change of load, steady on noise.
        self.idle_ns_avg = if self.idle_ns_avg >= u64::MAX / 2 {
            idle_ns
        } else {
            (self.idle_ns_avg * 7 + idle_ns) / 8
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DELAY_NS: u64 = 20_000;

    /// Runs one wake-up: `requests` arrive, then the thread parks and idles `idle_ns`.
    fn wake(st: &mut ThreadState, requests: u32, idle_ns: u64) -> bool {
        st.requests = requests;
        let waited = st.before_park(DELAY_NS);
        st.after_unpark(idle_ns);
        waited
    }

    #[test]
    fn back_to_back_requests_make_it_wait_and_batches_keep_it_waiting() {
        let mut st = ThreadState::new();
        // Requests one at a time with 3 µs gaps: it starts to wait once it has seen them; the
        // wait found one request only, so it skips one park before trying again.
        let waits: Vec<bool> = (0..4).map(|_| wake(&mut st, 1, 3_000)).collect();
        assert_eq!(waits, [false, true, false, true]);
        // The wait paid (4 requests in the next wake-up): it keeps waiting.
        let mut st = ThreadState::new();
        wake(&mut st, 1, 3_000);
        assert!(wake(&mut st, 1, 0));
        for _ in 0..100 {
            assert!(wake(&mut st, 4, 0));
        }
    }

    #[test]
    fn a_client_that_waits_for_each_reply_is_never_delayed() {
        let mut st = ThreadState::new();
        // QD1 with a 60 µs round trip: the gaps are longer than the wait.
        for _ in 0..1000 {
            assert!(!wake(&mut st, 1, 60_000));
        }
    }

    #[test]
    fn waits_that_buy_nothing_back_off_exponentially() {
        let mut st = ThreadState::new();
        // A fast QD1 client: 5 µs gaps, but never more than one request per wake-up.
        let waits: Vec<bool> = (0..40).map(|_| wake(&mut st, 1, 5_000)).collect();
        let waited = waits.iter().filter(|&&w| w).count();
        // Waits at parks 2, 4, 7, 12, 21, 38: each miss doubles the run of parks skipped.
        assert_eq!(waited, 6, "{waits:?}");
        assert_eq!(st.backoff_parks, 64);
        for _ in 0..10_000 {
            wake(&mut st, 1, 5_000);
        }
        assert_eq!(st.backoff_parks, BACKOFF_MAX_PARKS);
        // At most one wait in BACKOFF_MAX_PARKS + 1 parks once backed off fully.
        let waited = (0..1000).filter(|_| wake(&mut st, 1, 5_000)).count();
        assert!(waited <= 1000 / BACKOFF_MAX_PARKS as usize + 1, "{waited}");
    }

    #[test]
    fn no_requests_no_wait() {
        let mut st = ThreadState::new();
        wake(&mut st, 1, 1_000);
        // A wake-up for a timer or an API call reads no request: no reason to wait.
        assert!(!wake(&mut st, 0, 1_000));
    }
}
