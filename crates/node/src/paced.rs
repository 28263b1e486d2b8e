//! Pacing of the node's own background I/O (the rebuild of lost copies, the scrub): one
//! extent-sized step at a time, at a rate the operator sets live.
//!
//! Why a module of its own: the rebuild and the scrub pace alike and must not drift apart.
//! With a QoS scheduler the task is a tenant of it: registered under a volume key of its
//! own with a fixed rate (baseline = ceiling, no burst), and every step waits for the policy
//! to dispatch a grant of its size (`pipeline::Grant`), so the policy charges the step against
//! the node's capacity like any request and a rate change is a QoS change, applied at once.
//! Without a scheduler (`--policy off`) the task paces itself: the next step starts when the
//! bytes done since an origin fit the rate; a rate change restarts the count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use headroom_qos::{IoRate, OpKind, VolumeQos};

use crate::pipeline::{Grant, IoJob, IoRuntime};
use crate::scheduler::Ticket;
use crate::scheduler::{IoDesc, Scheduler, VolumeHandle};

/// How long a step waits for its grant before it checks that the node still runs.
const GRANT_WAIT: Duration = Duration::from_millis(200);

/// A background task's seat in the QoS scheduler.
#[derive(Debug)]
pub struct SchedulerSeat {
    pub io: Arc<IoRuntime>,
    pub scheduler: Arc<Scheduler<IoJob>>,
    handle: Arc<VolumeHandle>,
}

impl SchedulerSeat {
    /// Registers volume key `key` at `rate_bytes_per_s` with `scheduler`.
    pub fn new(
        io: Arc<IoRuntime>,
        scheduler: Arc<Scheduler<IoJob>>,
        key: u64,
        rate_bytes_per_s: u64,
    ) -> SchedulerSeat {
        let handle = scheduler.add_volume(key, &fixed_rate_qos(rate_bytes_per_s));
        SchedulerSeat {
            io,
            scheduler,
            handle,
        }
    }

    /// Changes the seat's rate; the next grant follows it.
    pub fn set_rate(&self, rate_bytes_per_s: u64) {
        self.scheduler
            .update_qos(&self.handle, &fixed_rate_qos(rate_bytes_per_s));
    }
}

/// A background task's rate, changed live, and its seat in the scheduler when there is one.
#[derive(Debug)]
pub struct PacedRate {
    rate_bytes_per_s: AtomicU64,
    seat: Option<SchedulerSeat>,
}

impl PacedRate {
    /// At `rate_bytes_per_s` (at least 1), registered under volume key `key` with
    /// `scheduler` when given.
    pub fn new(
        rate_bytes_per_s: u64,
        key: u64,
        scheduler: Option<(Arc<IoRuntime>, Arc<Scheduler<IoJob>>)>,
    ) -> PacedRate {
        PacedRate {
            rate_bytes_per_s: AtomicU64::new(rate_bytes_per_s.max(1)),
            seat: scheduler
                .map(|(io, scheduler)| SchedulerSeat::new(io, scheduler, key, rate_bytes_per_s)),
        }
    }

    pub fn rate_bytes_per_s(&self) -> u64 {
        self.rate_bytes_per_s.load(Ordering::Acquire)
    }

    /// Changes the rate (at least 1 byte/s); the next step follows it.
    pub fn set(&self, rate_bytes_per_s: u64) {
        self.rate_bytes_per_s
            .store(rate_bytes_per_s.max(1), Ordering::Release);
        if let Some(seat) = &self.seat {
            seat.set_rate(rate_bytes_per_s);
        }
    }

    /// Whether the steps go through the QoS scheduler.
    pub fn scheduled(&self) -> bool {
        self.seat.is_some()
    }

    /// A pacer for one run of the task, from now.
    pub fn pacer(&self) -> Pacer<'_> {
        Pacer::new(self.seat.as_ref(), self.rate_bytes_per_s())
    }
}

/// The scheduler QoS of a background task at `rate_bytes_per_s`: that many bytes per second,
/// as baseline and ceiling, in extent-sized operations.
pub fn fixed_rate_qos(rate_bytes_per_s: u64) -> VolumeQos {
    let rate = rate_bytes_per_s.max(1);
    VolumeQos::fixed(IoRate {
        iops: rate.div_ceil(headroom_store::EXTENT_SIZE_BYTES).max(1),
        bytes_per_s: rate,
    })
}

/// Paces the steps of one run of a task (a volume's rebuild, a scrub pass).
#[derive(Debug)]
pub struct Pacer<'a> {
    seat: Option<&'a SchedulerSeat>,
    rate_bytes_per_s: u64,
    origin: Instant,
    bytes_since_origin: u64,
}

/// A step's turn: with a scheduler, the grant to complete once the step is done.
#[must_use = "a turn from the scheduler must be given back with Pacer::done"]
#[derive(Debug)]
pub struct Turn(Option<Ticket>);

impl<'a> Pacer<'a> {
    pub fn new(seat: Option<&'a SchedulerSeat>, rate_bytes_per_s: u64) -> Pacer<'a> {
        Pacer {
            seat,
            rate_bytes_per_s: rate_bytes_per_s.max(1),
            origin: Instant::now(),
            bytes_since_origin: 0,
        }
    }

    /// Waits for the turn of a step described by `desc`. `rate_now` reads the task's current
    /// rate, `wait_until` sleeps until a deadline or the task is woken, `alive` says whether
    /// the node still runs. `None`: the node stopped meanwhile.
    pub fn turn(
        &mut self,
        desc: IoDesc,
        rate_now: impl Fn() -> u64,
        wait_until: impl Fn(Instant),
        alive: impl Fn() -> bool,
    ) -> Option<Turn> {
        let Some(seat) = self.seat else {
            loop {
                let rate = rate_now().max(1);
                if rate != self.rate_bytes_per_s {
                    self.rate_bytes_per_s = rate;
                    self.origin = Instant::now();
                    self.bytes_since_origin = 0;
                }
                let due = self.origin
                    + Duration::from_secs_f64(self.bytes_since_origin as f64 / rate as f64);
                if Instant::now() >= due {
                    return Some(Turn(None));
                }
                if !alive() {
                    return None;
                }
                wait_until(due);
            }
        };
        let pending = Grant::submit(&seat.io, &seat.scheduler, &seat.handle, desc);
        loop {
            if let Some(ticket) = pending.wait(GRANT_WAIT) {
                return Some(Turn(Some(ticket)));
            }
            if !alive() {
                return None; // dropping `pending` gives it up
            }
        }
    }

    /// Ends a step that did `bytes` of I/O: gives its grant back.
    pub fn done(&mut self, turn: Turn, bytes: u64) {
        self.bytes_since_origin += bytes;
        if let (Some(seat), Turn(Some(ticket))) = (self.seat, turn) {
            Grant::complete(&seat.io, &seat.scheduler, ticket);
        }
    }

    /// Bytes per second done since the origin (the start, or the last rate change without a
    /// scheduler).
    pub fn bytes_per_s(&self) -> u64 {
        let elapsed_s = self.origin.elapsed().as_secs_f64();
        if elapsed_s > 0.0 {
            (self.bytes_since_origin as f64 / elapsed_s) as u64
        } else {
            0
        }
    }
}

/// The descriptor a step of `bytes` at logical `extent` is charged as.
pub fn step_desc(op: OpKind, extent: u64, bytes: u64) -> IoDesc {
    IoDesc {
        op,
        offset_bytes: extent.saturating_mul(headroom_store::EXTENT_SIZE_BYTES),
        len_bytes: u32::try_from(bytes).unwrap_or(u32::MAX),
        syncs: 0,
    }
}
