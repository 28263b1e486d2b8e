//! When a paced queue of the vhost-user-blk load generator starts its requests
//! (`headroom lab vhost-load --rate-iops N`): a schedule of start times, the depth that bounds
//! it, and what the queue's thread waits for in between.
//!
//! Why a module of its own, and pure: the generator's loop is driven by a device and a clock,
//! so the only way to test the pacing deterministically (no sleeps, no timing assertions) is
//! to keep every decision here, as a function of the time the caller read (ns since the run's
//! start) and the requests it has in flight. Nothing here reads a clock or sleeps.
//!
//! The schedule (docs/ARCHITECTURE.md decision 72): N starts per second for the device,
//! evenly spaced: the device's `j`-th start (from 0) is due `ceil(j × 10^9 / N)` ns after the
//! run's start, and queue `q` of `Q` takes `j = q, q + Q, q + 2Q, …`, so each queue gets its
//! share and the queues interleave. It is absolute, as fio's `rate_iops` is: a start that
//! goes late (its thread woke late, the queue was full) does not move the ones after it, so
//! the rate holds over the run. At most `depth` requests are in flight on a queue; a start
//! whose time has passed while the queue was full starts as soon as a slot frees. What
//! differs from fio: the starts owed (due and not started) never exceed the depth. When more
//! are due (the device slower than the rate for longer than `depth` intervals, or the thread
//! descheduled that long), the oldest are skipped (counted, never started), so a stall is
//! followed by at most `depth` starts at once, as many as were possible anyway, and not by a
//! closed-loop run at full speed until the schedule is caught up. Latency is measured by the
//! caller from a request's actual start (as fio's `clat` is), not from its due time; the lag
//! between the two is what [`Starts::first`] lets it count.

/// Why a schedule cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacingError {
    #[error("the rate must be at least 1 request per second")]
    ZeroRate,
    #[error("queue {queue} of {queues}: no such queue")]
    Queue { queue: u16, queues: u16 },
    #[error("the depth must be at least 1")]
    ZeroDepth,
}

/// One queue's share of a device's schedule of `rate_iops` starts per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    rate_iops: u64,
    queues: u64,
    queue: u64,
}

const NS_PER_S: u128 = 1_000_000_000;

impl Schedule {
    /// Queue `queue` (from 0) of `queues` of a device paced at `rate_iops`.
    pub fn new(rate_iops: u64, queues: u16, queue: u16) -> Result<Schedule, PacingError> {
        if rate_iops == 0 {
            return Err(PacingError::ZeroRate);
        }
        if queue >= queues {
            return Err(PacingError::Queue { queue, queues });
        }
        Ok(Schedule {
            rate_iops,
            queues: u64::from(queues),
            queue: u64::from(queue),
        })
    }

    /// When the queue's `k`-th start (from 0) is due, ns after the run's start.
    pub fn due_ns(&self, k: u64) -> u64 {
        let j = u128::from(k) * u128::from(self.queues) + u128::from(self.queue);
        let rate = u128::from(self.rate_iops);
        u64::try_from((j * NS_PER_S).div_ceil(rate)).unwrap_or(u64::MAX)
    }

    /// How many of the queue's starts are due at `now_ns` (those with `due_ns(k) <= now_ns`).
    pub fn due_by(&self, now_ns: u64) -> u64 {
        // ceil(j × 10^9 / N) ≤ t  ⇔  j × 10^9 / N ≤ t  ⇔  j ≤ floor(t × N / 10^9).
        let last_j = u128::from(now_ns) * u128::from(self.rate_iops) / NS_PER_S;
        let queue = u128::from(self.queue);
        if last_j < queue {
            return 0;
        }
        u64::try_from((last_j - queue) / u128::from(self.queues) + 1).unwrap_or(u64::MAX)
    }
}

/// What the queue's thread waits for once it has started what [`Pacer::poll`] said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Every slot is in flight: nothing can start before a completion frees one (the next
    /// start may be due already; it starts then).
    Completion,
    /// Nothing is in flight and the next start is due at this time (ns after the run's
    /// start): nothing can happen before it.
    Until(u64),
    /// Requests in flight and a slot free: a completion, or the next start's time (ns after
    /// the run's start), whichever comes first.
    CompletionOrUntil(u64),
}

/// What to do now: start `count` requests (the queue's starts `first` to
/// `first + count - 1`, due at [`Schedule::due_ns`] of each), then wait for `wait`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Starts {
    pub count: u16,
    pub first: u64,
    pub wait: Wait,
}

/// One queue's pacing: its schedule, its depth, how far it has got.
#[derive(Clone, Debug)]
pub struct Pacer {
    schedule: Schedule,
    depth: u16,
    /// The index of the next start not taken (started or skipped).
    next: u64,
    skipped: u64,
}

impl Pacer {
    /// A queue that keeps at most `depth` requests in flight on `schedule`.
    pub fn new(schedule: Schedule, depth: u16) -> Result<Pacer, PacingError> {
        if depth == 0 {
            return Err(PacingError::ZeroDepth);
        }
        Ok(Pacer {
            schedule,
            depth,
            next: 0,
            skipped: 0,
        })
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Starts skipped so far because more than the depth were owed.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// At `now_ns` (after the run's start) with `in_flight` of the queue's requests in
    /// flight: how many to start now and what to wait for next. What it returns to start is
    /// taken: the caller must start them.
    pub fn poll(&mut self, now_ns: u64, in_flight: u16) -> Starts {
        let depth = u64::from(self.depth);
        let due = self.schedule.due_by(now_ns);
        let mut owed = due.saturating_sub(self.next);
        if owed > depth {
            // Owed beyond the depth could never have been in flight together: dropped.
            self.skipped += owed - depth;
            self.next = due - depth;
            owed = depth;
        }
        let free = depth.saturating_sub(u64::from(in_flight));
        let count = owed.min(free);
        let first = self.next;
        self.next += count;
        let in_flight_after = u64::from(in_flight) + count;
        let next_due_ns = self.schedule.due_ns(self.next);
        let wait = if in_flight_after >= depth {
            Wait::Completion
        } else if in_flight_after == 0 {
            Wait::Until(next_due_ns)
        } else {
            Wait::CompletionOrUntil(next_due_ns)
        };
        Starts {
            // count <= depth <= u16::MAX.
            count: u16::try_from(count).unwrap_or(u16::MAX),
            first,
            wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn pacer(rate_iops: u64, queues: u16, queue: u16, depth: u16) -> Pacer {
        Pacer::new(Schedule::new(rate_iops, queues, queue).unwrap(), depth).unwrap()
    }

    #[test]
    fn starts_are_evenly_spaced_at_the_rate() {
        let s = Schedule::new(1000, 1, 0).unwrap();
        let due: Vec<u64> = (0..4).map(|k| s.due_ns(k)).collect();
        assert_eq!(due, [0, MS, 2 * MS, 3 * MS]);
        // A rate that does not divide a second: no drift, each start at ceil(k × 10^9 / 3).
        let s = Schedule::new(3, 1, 0).unwrap();
        assert_eq!(s.due_ns(1), 333_333_334);
        assert_eq!(s.due_ns(3), 1_000_000_000);
        assert_eq!(s.due_ns(3_000), 1_000_000_000_000);
    }

    #[test]
    fn due_by_counts_exactly_the_starts_due() {
        for (rate, queues) in [(1000, 1), (3, 1), (1000, 4), (7, 3), (1, 2)] {
            for queue in 0..queues {
                let s = Schedule::new(rate, queues, queue).unwrap();
                for k in 0..50 {
                    let t = s.due_ns(k);
                    assert_eq!(
                        s.due_by(t),
                        k + 1,
                        "rate {rate} queue {queue}/{queues} k {k}"
                    );
                    if t > 0 {
                        assert_eq!(s.due_by(t - 1), k, "rate {rate} queue {queue}/{queues}");
                    }
                }
            }
        }
    }

    #[test]
    fn queues_share_the_rate_and_interleave() {
        let queues: Vec<Schedule> = (0..4).map(|q| Schedule::new(1000, 4, q).unwrap()).collect();
        // The device's starts: one per millisecond, queue 0, 1, 2, 3, 0, ...
        let mut all: Vec<(u64, usize)> = queues
            .iter()
            .enumerate()
            .flat_map(|(q, s)| (0..10).map(move |k| (s.due_ns(k), q)))
            .collect();
        all.sort_unstable();
        for (j, (t, q)) in all.iter().enumerate() {
            assert_eq!(*t, j as u64 * MS);
            assert_eq!(*q, j % 4);
        }
        // Over one second, each queue a quarter of the rate.
        for s in &queues {
            assert_eq!(s.due_by(1_000 * MS - 1), 250);
        }
    }

    #[test]
    fn a_queue_with_room_starts_each_request_at_its_time_and_sleeps_in_between() {
        let mut p = pacer(1000, 1, 0, 1);
        assert_eq!(
            p.poll(0, 0),
            Starts {
                count: 1,
                first: 0,
                wait: Wait::Completion
            }
        );
        // It completed after 0.3 ms: nothing is due before 1 ms.
        assert_eq!(
            p.poll(300_000, 0),
            Starts {
                count: 0,
                first: 1,
                wait: Wait::Until(MS)
            }
        );
        assert_eq!(p.poll(MS, 0).count, 1);
        assert_eq!(p.skipped(), 0);
    }

    #[test]
    fn a_start_due_while_the_queue_is_full_starts_when_a_slot_frees() {
        let mut p = pacer(1000, 1, 0, 1);
        assert_eq!(p.poll(0, 0).count, 1);
        // Start 1 falls due at 1 ms while start 0 is still in flight: it waits.
        let full = p.poll(1_500_000, 1);
        assert_eq!(full.count, 0);
        assert_eq!(full.wait, Wait::Completion);
        // Start 0 completes at 1.7 ms: start 1 goes at once, late by 0.7 ms.
        let freed = p.poll(1_700_000, 0);
        assert_eq!((freed.count, freed.first), (1, 1));
        assert_eq!(freed.wait, Wait::Completion);
        // Start 2 keeps its own time (2 ms): the schedule is not moved by the late one.
        assert_eq!(p.poll(1_800_000, 0).wait, Wait::Until(2 * MS));
        assert_eq!(p.skipped(), 0);
    }

    #[test]
    fn no_more_than_the_depth_is_owed_after_a_stall() {
        let mut p = pacer(1000, 1, 0, 4);
        assert_eq!(p.poll(0, 0).count, 1);
        // 20 ms with the thread away (or the device stuck): 20 more starts are due.
        let after = p.poll(20 * MS, 0);
        assert_eq!(after.count, 4, "at most the depth at once");
        // Starts 1..=16 skipped, 17..=20 started (the latest, so their lag is the least).
        assert_eq!(after.first, 17);
        assert_eq!(p.skipped(), 16);
        assert_eq!(after.wait, Wait::Completion);
        // And then the schedule again: start 21 at 21 ms, nothing owed before it.
        let next = p.poll(20 * MS + 1, 3);
        assert_eq!(next.count, 0);
        assert_eq!(next.wait, Wait::CompletionOrUntil(21 * MS));
    }

    #[test]
    fn overdue_starts_fill_the_free_slots_and_the_rest_wait_for_completions() {
        let mut p = pacer(1000, 1, 0, 4);
        assert_eq!(p.poll(0, 0).count, 1);
        // At 3 ms starts 1, 2 and 3 are due with 3 in flight: one slot, one start.
        let s = p.poll(3 * MS, 3);
        assert_eq!((s.count, s.first, s.wait), (1, 1, Wait::Completion));
        // Two complete: the two still owed start.
        let s = p.poll(3 * MS + 10, 2);
        assert_eq!((s.count, s.first), (2, 2));
        assert_eq!(s.wait, Wait::Completion);
        let s = p.poll(3 * MS + 20, 3);
        assert_eq!((s.count, s.wait), (0, Wait::CompletionOrUntil(4 * MS)));
        assert_eq!(p.skipped(), 0);
    }

    #[test]
    fn over_a_second_a_fast_device_sees_exactly_the_rate() {
        // A device answering in 0.2 ms, the loop looking every 0.1 ms: 1,000 starts in a
        // second at 1,000 IOPS, never more than the depth in flight, none skipped.
        let mut p = pacer(1000, 1, 0, 2);
        let mut in_flight: Vec<u64> = Vec::new();
        let mut started = 0u64;
        for step in 0..10_000u64 {
            let now = step * 100_000;
            in_flight.retain(|done| *done > now);
            let s = p.poll(now, in_flight.len() as u16);
            for _ in 0..s.count {
                in_flight.push(now + 200_000);
            }
            started += u64::from(s.count);
            assert!(in_flight.len() <= 2);
        }
        assert_eq!(started, 1_000);
        assert_eq!(p.skipped(), 0);
    }

    #[test]
    fn a_slow_device_runs_at_its_own_pace_without_bursts() {
        // A device answering in 3 ms at QD1 under a 1,000 IOPS schedule: one start per
        // completion (closed loop at the device's pace), the excess skipped.
        let mut p = pacer(1000, 1, 0, 1);
        let mut started = 0u64;
        let mut now = 0u64;
        while now < 30 * MS {
            let s = p.poll(now, 0);
            assert!(s.count <= 1);
            started += u64::from(s.count);
            now += 3 * MS;
        }
        assert_eq!(started, 10);
        // By the last look (27 ms) 28 starts were due: each started or skipped, none owed.
        assert_eq!(p.skipped(), 28 - 10);
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert_eq!(Schedule::new(0, 1, 0), Err(PacingError::ZeroRate));
        assert_eq!(
            Schedule::new(10, 2, 2),
            Err(PacingError::Queue {
                queue: 2,
                queues: 2
            })
        );
        let s = Schedule::new(10, 1, 0).unwrap();
        assert_eq!(Pacer::new(s, 0).err(), Some(PacingError::ZeroDepth));
    }
}
