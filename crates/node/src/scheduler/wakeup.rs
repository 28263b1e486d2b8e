//! The wake-up thread: when a policy answers `WaitUntil`, its worker is armed here, and one
//! thread drives the worker again when the time falls due (nobody else may touch it then).

use std::sync::{Arc, Condvar, Mutex, Weak};

use super::{Ready, Scheduler};
use crate::clock::Clock;
use crate::sync::lock;

/// Wake-up times per worker, served by one thread.
pub(super) struct Wakeups {
    deadlines: Mutex<WakeState>,
    changed: Condvar,
}

struct WakeState {
    deadline_ns: Vec<u64>,
    stop: bool,
}

impl Wakeups {
    /// No wake-up armed for any of `workers`.
    pub(super) fn new(workers: usize) -> Self {
        Wakeups {
            deadlines: Mutex::new(WakeState {
                deadline_ns: vec![u64::MAX; workers],
                stop: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// Ends the wake-up thread.
    pub(super) fn stop(&self) {
        lock(&self.deadlines).stop = true;
        self.changed.notify_all();
    }

    /// Asks for worker `w` to be woken at `at_ns` (keeps an earlier request).
    pub(super) fn arm(&self, w: usize, at_ns: u64) {
        let mut state = lock(&self.deadlines);
        let earliest_before = state.deadline_ns.iter().copied().min().unwrap_or(u64::MAX);
        if at_ns < state.deadline_ns[w] {
            state.deadline_ns[w] = at_ns;
        }
        if at_ns < earliest_before {
            self.changed.notify_one();
        }
    }
}

pub(super) fn wake_loop<J: Send + 'static>(
    scheduler: Weak<Scheduler<J>>,
    wakeups: Arc<Wakeups>,
    clock: Clock,
) {
    crate::clock::wake_on_time();
    let mut due = Vec::new();
    loop {
        {
            let mut state = lock(&wakeups.deadlines);
            loop {
                if state.stop {
                    return;
                }
                let now = clock.now_ns();
                let earliest = state.deadline_ns.iter().copied().min().unwrap_or(u64::MAX);
                if earliest <= now {
                    for (w, deadline) in state.deadline_ns.iter_mut().enumerate() {
                        if *deadline <= now {
                            *deadline = u64::MAX;
                            due.push(w);
                        }
                    }
                    break;
                }
                // Without a deadline, check every 100 ms whether the scheduler still exists.
                let wait = if earliest == u64::MAX {
                    std::time::Duration::from_millis(100)
                } else {
                    clock.until(earliest)
                };
                state = wakeups
                    .changed
                    .wait_timeout(state, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if scheduler.strong_count() == 0 {
                    return;
                }
            }
        }
        let Some(scheduler) = scheduler.upgrade() else {
            return;
        };
        for w in due.drain(..) {
            scheduler.wake(w);
        }
    }
}

impl<J: Send + 'static> Scheduler<J> {
    /// A timer of worker `w` fell due.
    pub(super) fn wake(self: &Arc<Self>, w: usize) {
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        {
            let mut state = lock(&self.workers[w].state);
            // Armed again for a later time by someone else: nothing is due.
            if state.armed_ns > now && state.armed_ns != u64::MAX {
                self.wakeups.arm(w, state.armed_ns);
                return;
            }
            state.armed_ns = u64::MAX;
            self.drain(w, &mut state, now, &mut ready);
        }
        self.gate.admit(&mut ready, 0);
        if !ready.is_empty() {
            self.runner.run(self, ready);
        }
    }

    /// Wakes, on the calling thread, every worker whose timer is due by the clock's time now:
    /// what the wake-up thread does when a deadline passes, for a clock whose time a test
    /// moves by hand (`Clock::manual`), so that when this returns the policies have decided
    /// everything that was due.
    pub fn wake_due(self: &Arc<Self>) {
        let now = self.clock.now_ns();
        for w in 0..self.workers.len() {
            let armed_ns = lock(&self.workers[w].state).armed_ns;
            if armed_ns <= now {
                self.wake(w);
            }
        }
    }

    /// Runs jobs released outside a submission (QoS change, removal).
    pub(super) fn run_elsewhere(&self, ready: Vec<Ready<J>>) {
        if ready.is_empty() {
            return;
        }
        if let Some(me) = self.me.upgrade() {
            self.runner.run(&me, ready);
        }
    }
}
