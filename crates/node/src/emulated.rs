//! An emulated block device: a known bottleneck on any machine.
//!
//! QoS experiments need a device whose capacity is known and well below what the machine can
//! really do. Otherwise the bottleneck is whatever the test machine's RAM, page cache or SSD
//! happens to be that day. The emulated device supplies that capacity. The data operation
//! still runs at once on the caller's thread, as a real `memcpy` into RAM or a real file read
//! or write. The emulation only decides **when the request completes**, and the caller holds
//! back the completion (the NBD reply) until then with [`EmulatedDevice::complete_at`].
//!
//! # The model
//!
//! Costs come from the Linux blk-iocost linear model, the one the scheduler's cost model
//! already uses ([`IoCostModel::cost_ns`]). So the scheduler's estimate of a read or write and
//! the emulated device's service of it agree exactly. Per direction the model has a byte rate
//! (`rbps`, `wbps`, bytes/s) and two 4 KiB IOPS rates (`*seqiops`, `*randiops`). From these
//! come a per-page cost and a sequential and a random base cost, and one request costs
//! `base + max(len / 4 KiB, 1) × page` **device nanoseconds**. A device does 10⁹ device-ns
//! per second.
//!
//! The device has `parallelism` channels (e.g. NVMe queues or flash channels). It serves up to
//! that many requests at once. A request occupies one channel for its **service time**,
//! `cost_ns × parallelism` wall nanoseconds. As a result:
//! - a saturated device finishes `10⁹ / cost_ns` such requests per second, which is exactly the
//!   model's rate;
//! - an idle device answers a 4 KiB random read in `parallelism / rrandiops` seconds. Latency
//!   at low load grows with parallelism, as on a real device whose throughput comes from
//!   concurrency.
//!
//! Requests are served in booking order (FIFO). Each takes the channel that frees first and
//! starts at `max(now, that channel's free time, previous request's start)`.
//!
//! **A non-linear cost curve** (optional, [`EmulatedDevice::start_with_curve`],
//! `[storage.emulated] curve`): instead of the linear model, a Libra VOP curve
//! ([`VopCurve`], the type of the scheduler's `qos.cost.device.vop`) gives each size's achieved
//! IOPS per direction, and a read or write of `len` bytes costs `⌈10⁹ / achieved(len)⌉` device
//! ns (achieved IOPS interpolated linearly between points, constant bandwidth past the last
//! one, [`VopCurve::achieved_iops`]). The scheduler charging the same curve in milli-VOPs
//! (`⌈max_iops × 1000 / achieved⌉`, capacity `max_iops × 1000` per second) then books the same
//! fraction of a second per request as the device serves, up to its rounding up by less than one
//! milli-VOP. Sequential and random requests cost the same (the curve has no sequential
//! points), and flush, trim and write-zeroes cost one 4 KiB write of the write curve.
//!
//! **Read/write interference** (optional): a read that starts while `w` of the `P` channels run
//! writes takes `write_interference_permille / 1000 × w / P` longer. For example, 1000 ‰ with
//! every channel busy writing doubles the read's service time. This mimics flash, where
//! programs and erases block reads on the same die.
//!
//! **Flush, trim and write-zeroes**: each costs one 4 KiB random write
//! (`cost_ns(Write, 4096, random)` ≈ `1 s / wrandiops`), whatever its length. A real device
//! does a metadata (FTL) update for these, not a data transfer. Costing them by length would
//! let one 1 GiB write-zeroes hold a channel for seconds. Making them free would hide a storm
//! of them. They count as writes for interference. A flush is not a barrier: it does not wait
//! for earlier writes. Note that [`IoCostModel::cost_ns`] charges these ops 0, so for them
//! alone the scheduler's estimate is lower than the emulated device's service by that cost.
//!
//! # Virtual time
//!
//! [`EmulatedDevice::book`] is pure arithmetic on virtual times (nanoseconds on the node's
//! [`Clock`]). It never sleeps and never waits for the completion thread. So the device's
//! throughput is exact however late the completion thread wakes. Wake-up overshoot (timer
//! slack, scheduling delay, typically tens of µs) adds that much latency to a reply. It does
//! not lose throughput, because the next request's start time does not depend on when the
//! previous reply was actually sent.
//!
//! # Threads and locks
//!
//! Booking state (channel free times) sits behind its own mutex, taken once per `book`. The
//! pending completions are a min-heap behind another mutex, taken once per `complete_at`. The
//! completion thread (`headroom-emu`) waits on a condvar until the earliest deadline. It runs
//! every due completion outside the lock, and is woken early only when a new earliest deadline
//! arrives. Dropping the device stops the thread after running every pending completion at
//! once, so replies are never lost.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};

use headroom_qos::model::{self, IoCostModel, VopCurve};
use headroom_qos::routing::{MAX_STREAMS, StreamTracker};
use headroom_qos::{NS_PER_S, OpKind};
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::sync::lock;

/// Largest allowed `parallelism`.
pub const MAX_PARALLELISM: u32 = 1024;
/// Largest allowed `write_interference_permille` (10× slower reads at full write load).
pub const MAX_WRITE_INTERFERENCE_PERMILLE: u32 = 10_000;

/// Errors from configuring or starting an emulated device.
#[derive(Debug, thiserror::Error)]
pub enum EmulatedError {
    /// A configuration value is out of range.
    #[error("emulated device: `{key}` = {value} is invalid: {allowed}")]
    Invalid {
        /// The key, as written under `[storage.emulated]` (e.g. `model.rbps`).
        key: &'static str,
        /// The value given.
        value: u64,
        /// What is allowed.
        allowed: &'static str,
    },
    /// A cost curve is not usable (`key` names the part, e.g. `curve.read`).
    #[error("emulated device: `{key}` {problem}")]
    InvalidCurve {
        /// The part of the curve, as written under `[storage.emulated]`.
        key: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// The completion thread could not be started.
    #[error("emulated device: cannot start the completion thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// Configuration (TOML/serde; used as `[storage.emulated]` in the node config file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmulatedDeviceSpec {
    /// The device's rates, as IOCost's model (bytes/s and 4 KiB IOPS per direction, sequential
    /// and random).
    pub model: IoCostModel,
    /// Requests the device serves at once (internal parallelism, e.g. NVMe channels). A request
    /// occupies one channel for `cost_ns × parallelism`, so a saturated device achieves exactly
    /// the model's rates, and an idle device answers one 4 KiB random read in
    /// `parallelism / rrandiops` seconds.
    pub parallelism: u32,
    /// Read/write interference: a read that starts while writes occupy channels takes longer by
    /// this many thousandths times the fraction of channels busy with writes (0 = none).
    #[serde(default)]
    pub write_interference_permille: u32,
    /// One emulated device per pool device instead of one for the whole pool: a request
    /// books the devices its extents are on, so a volume striped over N devices gets N
    /// times one device's rates (`[storage.emulated] per_device`).
    #[serde(default)]
    pub per_device: bool,
    /// Streams the device recognises itself, as a disk head with readahead does
    /// (`headroom_qos::routing::StreamTracker`, the simulator's device model): a request is
    /// sequential when it starts within 16 MiB of where one of the last `streams` requests on
    /// this device ended, so one tenant's random I/O breaks up another's scan (FAST). `0`
    /// (the default): a request is sequential as its own connection saw it (the scheduler's
    /// per-connection classification), whatever else the device serves.
    #[serde(default)]
    pub streams: u32,
}

impl EmulatedDeviceSpec {
    /// Checks every rate > 0, `parallelism` in `1..=1024` and
    /// `write_interference_permille <= 10_000`. The error names the key, the value and what is
    /// allowed.
    pub fn validate(&self) -> Result<(), EmulatedError> {
        let m = &self.model;
        let rates: [(&'static str, u64); 6] = [
            ("model.rbps", m.rbps),
            ("model.rseqiops", m.rseqiops),
            ("model.rrandiops", m.rrandiops),
            ("model.wbps", m.wbps),
            ("model.wseqiops", m.wseqiops),
            ("model.wrandiops", m.wrandiops),
        ];
        for (key, value) in rates {
            if value == 0 {
                return Err(EmulatedError::Invalid {
                    key,
                    value,
                    allowed: "every rate must be greater than 0",
                });
            }
        }
        if !(1..=MAX_PARALLELISM).contains(&self.parallelism) {
            return Err(EmulatedError::Invalid {
                key: "parallelism",
                value: u64::from(self.parallelism),
                allowed: "must be between 1 and 1024",
            });
        }
        if self.streams as usize > MAX_STREAMS {
            return Err(EmulatedError::Invalid {
                key: "streams",
                value: u64::from(self.streams),
                allowed: "must be at most 256 (0 = the connection's own classification)",
            });
        }
        if self.write_interference_permille > MAX_WRITE_INTERFERENCE_PERMILLE {
            return Err(EmulatedError::Invalid {
                key: "write_interference_permille",
                value: u64::from(self.write_interference_permille),
                allowed: "must be at most 10000 (0 = no interference)",
            });
        }
        Ok(())
    }

    /// Device nanoseconds one request costs. Reads and writes cost
    /// [`IoCostModel::cost_ns`] exactly. Flush, trim and write-zeroes cost one 4 KiB random
    /// write, whatever their length (see the module doc).
    pub fn cost_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> u64 {
        match op {
            OpKind::Read | OpKind::Write => {
                self.model.cost_ns(op, u64::from(len_bytes), sequential)
            }
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => {
                self.model.cost_ns(OpKind::Write, 4096, false)
            }
        }
    }

    /// Wall nanoseconds one request holds a channel when nothing interferes:
    /// `cost_ns × parallelism`.
    pub fn service_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> u64 {
        self.cost_ns(op, len_bytes, sequential)
            .saturating_mul(u64::from(self.parallelism.max(1)))
    }
}

/// Checks a cost curve for [`EmulatedDevice::start_with_curve`]: `max_iops` > 0, and per
/// direction at least one `(size, iops)` point, sizes > 0 and increasing, every IOPS > 0.
pub fn validate_curve(curve: &VopCurve) -> Result<(), EmulatedError> {
    if curve.max_iops == 0 {
        return Err(EmulatedError::InvalidCurve {
            key: "curve.max_iops",
            problem: "must be greater than 0".into(),
        });
    }
    for (key, points) in [("curve.read", &curve.read), ("curve.write", &curve.write)] {
        if points.is_empty() {
            return Err(EmulatedError::InvalidCurve {
                key,
                problem: "needs at least one [size, iops] point".into(),
            });
        }
        let mut previous = 0;
        for &(size, iops) in points {
            if size <= previous {
                return Err(EmulatedError::InvalidCurve {
                    key,
                    problem: format!(
                        "[{size}, {iops}]: sizes must be greater than 0 and increasing"
                    ),
                });
            }
            if iops == 0 {
                return Err(EmulatedError::InvalidCurve {
                    key,
                    problem: format!("[{size}, {iops}]: IOPS must be greater than 0"),
                });
            }
            previous = size;
        }
    }
    Ok(())
}

/// Device nanoseconds of one request on a curve: `⌈10⁹ / achieved IOPS⌉` (see the module doc).
pub fn curve_cost_ns(curve: &VopCurve, op: OpKind, len_bytes: u32) -> u64 {
    let (points, len) = match op {
        OpKind::Read => (&curve.read, u64::from(len_bytes)),
        OpKind::Write => (&curve.write, u64::from(len_bytes)),
        OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => (&curve.write, 4096),
    };
    NS_PER_S.div_ceil(VopCurve::achieved_iops(points, len).max(1))
}

/// Counters of an emulated device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmulatedStats {
    /// Requests booked.
    pub booked: u64,
    /// Device-busy nanoseconds summed over channels (service times, interference included).
    /// Divided by `parallelism` and elapsed time, this gives utilisation.
    pub busy_ns: u64,
    /// Completions waiting for their time (handed to `complete_at`, not yet run).
    pub pending: u64,
}

/// Booking state: when each channel frees, and which writes are still running.
#[derive(Debug)]
struct Booking {
    /// Free-at time of every channel (min-heap, `parallelism` entries).
    channels: BinaryHeap<Reverse<u64>>,
    /// End times of booked writes that were running at `last_start` (min-heap, at most
    /// `parallelism` entries once pruned).
    writes: BinaryHeap<Reverse<u64>>,
    /// Start of the most recently booked request; starts never go backwards (FIFO).
    last_start: u64,
    booked: u64,
    busy_ns: u64,
    /// The device's own stream tracking (`spec.streams > 0`).
    streams: Option<StreamTracker>,
}

/// One pending completion. Ordered by `(at, seq)` only.
struct Pending {
    at: u64,
    seq: u64,
    done: Box<dyn FnOnce() + Send + 'static>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct Queue {
    heap: BinaryHeap<Reverse<Pending>>,
    next_seq: u64,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

/// An emulated block device with a known capacity. See the module doc.
pub struct EmulatedDevice {
    spec: EmulatedDeviceSpec,
    /// A non-linear cost curve in place of `spec.model` (see the module doc).
    curve: Option<VopCurve>,
    booking: Mutex<Booking>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for EmulatedDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmulatedDevice")
            .field("spec", &self.spec)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl EmulatedDevice {
    /// Starts the completion thread (`headroom-emu`). It exits when the device is dropped,
    /// after running every pending completion at once (replies are never lost).
    pub fn start(
        spec: EmulatedDeviceSpec,
        clock: Clock,
    ) -> Result<Arc<EmulatedDevice>, EmulatedError> {
        EmulatedDevice::start_with_curve(spec, None, clock)
    }

    /// As [`EmulatedDevice::start`], but with `Some(curve)` reads and writes cost what the
    /// curve says instead of `spec.model` (see the module doc); parallelism, interference and
    /// everything else as in `spec`.
    pub fn start_with_curve(
        spec: EmulatedDeviceSpec,
        curve: Option<VopCurve>,
        clock: Clock,
    ) -> Result<Arc<EmulatedDevice>, EmulatedError> {
        spec.validate()?;
        if let Some(c) = &curve {
            validate_curve(c)?;
        }
        let p = spec.parallelism as usize;
        let mut channels = BinaryHeap::with_capacity(p);
        channels.extend(std::iter::repeat_n(Reverse(0u64), p));
        let booking = Booking {
            channels,
            writes: BinaryHeap::with_capacity(p + 1),
            last_start: 0,
            booked: 0,
            busy_ns: 0,
            streams: (spec.streams > 0).then(|| {
                StreamTracker::new(spec.streams as usize, model::IOCOST_SEQ_DISTANCE_BYTES)
            }),
        };
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                heap: BinaryHeap::new(),
                next_seq: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = thread::Builder::new()
            .name("headroom-emu".to_owned())
            .spawn(move || completion_loop(&thread_shared, clock))
            .map_err(EmulatedError::Spawn)?;
        Ok(Arc::new(EmulatedDevice {
            spec,
            curve,
            booking: Mutex::new(booking),
            shared,
            thread: Some(thread),
        }))
    }

    /// Books a request that reaches the device at `now_ns` and returns the time it completes.
    /// It takes the channel that frees first (FIFO: requests are served in booking order),
    /// starts at `max(now, channel free, previous request's start)`, and holds the channel for
    /// its service time (`cost_ns × parallelism`, plus write interference for a read). Pure
    /// arithmetic on virtual times (no sleeping), so throughput is exact however late the
    /// completion thread wakes.
    ///
    /// `position_bytes` is where on the device the request starts and `sequential` how its
    /// connection classified it; with `streams` set the device classifies it itself from the
    /// position (reads and writes; flush, trim and write-zeroes neither count nor move a
    /// stream).
    pub fn book(
        &self,
        now_ns: u64,
        op: OpKind,
        position_bytes: u64,
        len_bytes: u32,
        sequential: bool,
    ) -> u64 {
        let spec = &self.spec;
        let mut b = lock(&self.booking);
        let sequential = match (&mut b.streams, op) {
            (Some(streams), OpKind::Read | OpKind::Write) => {
                streams.observe(position_bytes, u64::from(len_bytes))
            }
            _ => sequential,
        };
        let mut service = self.service_ns(op, len_bytes, sequential);
        let Some(Reverse(free_at)) = b.channels.pop() else {
            // Unreachable: the heap always holds `parallelism` >= 1 entries.
            return now_ns.saturating_add(service);
        };
        let start = now_ns.max(free_at).max(b.last_start);
        b.last_start = start;
        // Writes that ended by `start` no longer occupy a channel. Starts never go backwards,
        // so pruning here is final.
        while b.writes.peek().is_some_and(|Reverse(end)| *end <= start) {
            b.writes.pop();
        }
        if op == OpKind::Read && spec.write_interference_permille > 0 && !b.writes.is_empty() {
            let busy = b.writes.len() as u128;
            let extra = u128::from(service) * u128::from(spec.write_interference_permille) * busy
                / (1000 * u128::from(spec.parallelism));
            service = service.saturating_add(u64::try_from(extra).unwrap_or(u64::MAX));
        }
        let end = start.saturating_add(service);
        b.channels.push(Reverse(end));
        if op != OpKind::Read && end > start {
            b.writes.push(Reverse(end));
        }
        b.booked += 1;
        b.busy_ns = b.busy_ns.saturating_add(service);
        end
    }

    /// Runs `done` on the completion thread at `at_ns` (at once if it has passed). Completions
    /// due at the same time run in the order they were handed in.
    pub fn complete_at(&self, at_ns: u64, done: Box<dyn FnOnce() + Send + 'static>) {
        let mut q = lock(&self.shared.queue);
        let seq = q.next_seq;
        q.next_seq += 1;
        let earliest = q.heap.peek().is_none_or(|Reverse(top)| at_ns < top.at);
        q.heap.push(Reverse(Pending {
            at: at_ns,
            seq,
            done,
        }));
        drop(q);
        if earliest {
            self.shared.wake.notify_one();
        }
    }

    /// Counters: requests booked, device-busy ns summed over channels, requests pending
    /// completion.
    pub fn stats(&self) -> EmulatedStats {
        let (booked, busy_ns) = {
            let b = lock(&self.booking);
            (b.booked, b.busy_ns)
        };
        let pending = lock(&self.shared.queue).heap.len() as u64;
        EmulatedStats {
            booked,
            busy_ns,
            pending,
        }
    }

    /// The device's configuration.
    pub fn spec(&self) -> &EmulatedDeviceSpec {
        &self.spec
    }

    /// Its cost curve, if it has one (then `spec().model` is not used).
    pub fn curve(&self) -> Option<&VopCurve> {
        self.curve.as_ref()
    }

    /// Device nanoseconds one request costs: the curve's ([`curve_cost_ns`]) if there is one,
    /// else [`EmulatedDeviceSpec::cost_ns`].
    pub fn cost_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> u64 {
        match &self.curve {
            Some(c) => curve_cost_ns(c, op, len_bytes),
            None => self.spec.cost_ns(op, len_bytes, sequential),
        }
    }

    /// Wall nanoseconds one request holds a channel when nothing interferes:
    /// `cost_ns × parallelism`.
    pub fn service_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> u64 {
        self.cost_ns(op, len_bytes, sequential)
            .saturating_mul(u64::from(self.spec.parallelism.max(1)))
    }
}

impl Drop for EmulatedDevice {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.wake.notify_one();
        if let Some(handle) = self.thread.take() {
            // A completion may hold the last reference to the device. Then we are on the
            // completion thread itself; it exits by itself once this completion returns.
            if handle.thread().id() != thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

fn completion_loop(shared: &Shared, clock: Clock) {
    crate::clock::wake_on_time();
    let mut due: Vec<Pending> = Vec::new();
    loop {
        let mut q = lock(&shared.queue);
        loop {
            let now = clock.now_ns();
            let flush_all = q.shutdown;
            while q
                .heap
                .peek()
                .is_some_and(|Reverse(top)| flush_all || top.at <= now)
            {
                if let Some(Reverse(p)) = q.heap.pop() {
                    due.push(p);
                }
            }
            if !due.is_empty() {
                break;
            }
            if q.shutdown {
                return;
            }
            let wait = q.heap.peek().map(|Reverse(top)| clock.until(top.at));
            q = match wait {
                Some(d) => {
                    shared
                        .wake
                        .wait_timeout(q, d)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => shared.wake.wait(q).unwrap_or_else(PoisonError::into_inner),
            };
        }
        drop(q);
        for p in due.drain(..) {
            // One panicking completion must not take the others' replies down with it.
            if std::panic::catch_unwind(AssertUnwindSafe(p.done)).is_err() {
                tracing::error!(at_ns = p.at, "emulated device: a completion panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    const KIB4: u32 = 4096;

    /// rrandiops 20,000 (4 KiB random read = 50 µs device time); rseqiops chosen so sequential
    /// reads are bandwidth-bound (base ≈ 0), so 128 KiB sequential reads can reach rbps.
    fn model() -> IoCostModel {
        IoCostModel {
            rbps: 200_000_000,
            rseqiops: 200_000_000 / 4096,
            rrandiops: 20_000,
            wbps: 100_000_000,
            wseqiops: 20_000,
            wrandiops: 10_000,
        }
    }

    fn spec(parallelism: u32, interference: u32) -> EmulatedDeviceSpec {
        EmulatedDeviceSpec {
            per_device: false,
            streams: 0,
            model: model(),
            parallelism,
            write_interference_permille: interference,
        }
    }

    fn device(parallelism: u32, interference: u32) -> Arc<EmulatedDevice> {
        EmulatedDevice::start(spec(parallelism, interference), Clock::new()).expect("device starts")
    }

    #[test]
    fn saturated_random_reads_finish_at_the_model_rate() {
        let dev = device(4, 0);
        let service = dev.spec().service_ns(OpKind::Read, KIB4, false);
        assert_eq!(dev.spec().cost_ns(OpKind::Read, KIB4, false), 50_000);
        assert_eq!(service, 200_000);
        let last = (0..10_000)
            .map(|_| dev.book(0, OpKind::Read, 0, KIB4, false))
            .max()
            .unwrap_or(0);
        let target: u64 = 500_000_000;
        assert!(last.abs_diff(target) <= service, "last = {last}");
        let stats = dev.stats();
        assert_eq!(stats.booked, 10_000);
        assert_eq!(stats.busy_ns, 10_000 * service);
        assert_eq!(stats.pending, 0);
    }

    #[test]
    fn idle_device_answers_in_parallelism_times_cost() {
        for p in [1, 4, 16] {
            let dev = device(p, 0);
            let cost = dev.spec().cost_ns(OpKind::Read, KIB4, false);
            let now = 1_000_000;
            assert_eq!(
                dev.book(now, OpKind::Read, 0, KIB4, false) - now,
                u64::from(p) * cost
            );
            // Idle again much later: same latency, no debt carried over.
            let later = 10_000_000_000;
            assert_eq!(
                dev.book(later, OpKind::Read, 0, KIB4, false) - later,
                u64::from(p) * cost
            );
        }
    }

    #[test]
    fn request_behind_a_queue_waits_what_the_model_says() {
        let dev = device(4, 0);
        let cost = dev.spec().cost_ns(OpKind::Read, KIB4, false);
        let service = 4 * cost;
        for _ in 0..32 {
            dev.book(0, OpKind::Read, 0, KIB4, false);
        }
        // 32 requests on 4 channels: 8 rounds of `service` ahead of us, i.e. 32 × cost.
        let end = dev.book(0, OpKind::Read, 0, KIB4, false);
        assert_eq!(end, 32 * cost + service);
        // Arriving part way through: the queue delay is what is left of the backlog. Channels
        // free at 8, 8, 8 and 9 services; arriving at 5 we start at 8 and end at 9.
        let dev = device(4, 0);
        for _ in 0..33 {
            dev.book(0, OpKind::Read, 0, KIB4, false);
        }
        let now = 5 * service;
        let end = dev.book(now, OpKind::Read, 0, KIB4, false);
        assert_eq!(end - now, 3 * service + service);
    }

    #[test]
    fn sequential_reads_reach_rbps_at_saturation() {
        let dev = device(8, 0);
        let len: u32 = 128 * 1024;
        let n: u64 = 2_000;
        let last = (0..n)
            .map(|_| dev.book(0, OpKind::Read, 0, len, true))
            .max()
            .unwrap_or(1);
        let bytes_per_s = u128::from(n * u64::from(len)) * 1_000_000_000 / u128::from(last);
        let rbps = u128::from(model().rbps);
        assert!(
            bytes_per_s.abs_diff(rbps) * 100 <= rbps,
            "{bytes_per_s} B/s vs rbps {rbps}"
        );
        // Whatever the model, saturated throughput is exactly 10⁹ / cost_ns requests per s.
        let cost = dev.spec().cost_ns(OpKind::Read, len, true);
        assert_eq!(last, n * cost);
    }

    #[test]
    fn with_streams_the_device_judges_sequential_by_position() {
        let seq = spec(1, 0).service_ns(OpKind::Read, KIB4, true);
        let rand = spec(1, 0).service_ns(OpKind::Read, KIB4, false);
        assert!(seq < rand);
        // Booked back to back at time 0 on one channel: each end minus the previous one is
        // the service time the device charged.
        let charged = |dev: &EmulatedDevice, reads: &[(u64, bool)]| -> Vec<u64> {
            let mut prev = 0;
            reads
                .iter()
                .map(|&(position, flag)| {
                    let end = dev.book(0, OpKind::Read, position, KIB4, flag);
                    let d = end - prev;
                    prev = end;
                    d
                })
                .collect()
        };
        // A scan at 0.. interleaved with a random reader 1 GiB away, every request flagged
        // sequential by its connection.
        let far = 1u64 << 30;
        let reads = [
            (0, true),
            (far, true),
            (4096, true),
            (far * 2, true),
            (8192, true),
        ];
        let mut one = spec(1, 0);
        one.streams = 1;
        let dev = EmulatedDevice::start(one, Clock::new()).expect("device starts");
        // One stream: the interleaving makes every request random (the first too: the head
        // starts nowhere).
        assert_eq!(charged(&dev, &reads), [rand; 5].to_vec());
        let mut two = spec(1, 0);
        two.streams = 2;
        let dev = EmulatedDevice::start(two, Clock::new()).expect("device starts");
        // Two streams: the scan continues its stream, the far reads start new ones.
        assert_eq!(charged(&dev, &reads), [rand, rand, seq, rand, seq].to_vec());
        // No streams: the connection's flag decides, whatever the position.
        let dev = device(1, 0);
        assert_eq!(charged(&dev, &reads), [seq; 5].to_vec());
        // Out of range is refused.
        let mut bad = spec(1, 0);
        bad.streams = 257;
        assert!(matches!(
            bad.validate(),
            Err(EmulatedError::Invalid { key: "streams", .. })
        ));
    }

    #[test]
    fn write_interference_slows_reads_during_writes_only() {
        // 4 channels, 1000 ‰: with 2 of 4 channels writing, a read takes 1.5× its service.
        let dev = device(4, 1000);
        let read = dev.spec().service_ns(OpKind::Read, KIB4, false);
        let w1 = dev.book(0, OpKind::Write, 0, KIB4, false);
        let w2 = dev.book(0, OpKind::Write, 0, KIB4, false);
        assert_eq!(w1, w2);
        let during = dev.book(0, OpKind::Read, 0, KIB4, false);
        assert_eq!(during, read + read / 2);
        // A read starting once both writes have finished is not slowed.
        let after = dev.book(w1, OpKind::Read, 0, KIB4, false);
        assert_eq!(after - w1, read);
        // Without interference configured, the same pattern is not slowed.
        let plain = device(4, 0);
        plain.book(0, OpKind::Write, 0, KIB4, false);
        plain.book(0, OpKind::Write, 0, KIB4, false);
        assert_eq!(plain.book(0, OpKind::Read, 0, KIB4, false), read);
        // Interference counts in busy time.
        let write = dev.spec().service_ns(OpKind::Write, KIB4, false);
        assert_eq!(dev.stats().busy_ns, 2 * write + read + read / 2 + read);
    }

    #[test]
    fn flush_trim_and_zeroes_cost_one_random_4k_write() {
        let s = spec(2, 0);
        let w = s.cost_ns(OpKind::Write, KIB4, false);
        assert_eq!(w, 100_000);
        for op in [OpKind::Flush, OpKind::Trim, OpKind::WriteZeroes] {
            assert_eq!(s.cost_ns(op, 0, false), w);
            assert_eq!(s.cost_ns(op, u32::MAX, true), w);
        }
        // Reads and writes agree with the scheduler's model exactly.
        for (op, len, seq) in [
            (OpKind::Read, KIB4, false),
            (OpKind::Read, 1 << 20, true),
            (OpKind::Write, 65_536, false),
        ] {
            assert_eq!(
                s.cost_ns(op, len, seq),
                s.model.cost_ns(op, u64::from(len), seq)
            );
        }
    }

    #[test]
    fn completions_run_at_their_deadline_in_deadline_order() {
        let clock = Clock::new();
        let dev = EmulatedDevice::start(spec(4, 0), clock).expect("device starts");
        let (tx, rx) = mpsc::channel();
        let base = clock.now_ns() + 2_000_000;
        let n: u64 = 200;
        // Deadlines over ~20 ms, handed in shuffled, in pairs that tie (same deadline).
        let mut deadlines = Vec::new();
        for i in 0..n {
            let slot = (i * 7_919) % n / 2;
            let at = base + slot * 200_000;
            deadlines.push(at);
            let tx = tx.clone();
            dev.complete_at(
                at,
                Box::new(move || {
                    let _ = tx.send((i, clock.now_ns()));
                }),
            );
        }
        let mut runs = Vec::new();
        for _ in 0..n {
            runs.push(
                rx.recv_timeout(Duration::from_secs(30))
                    .expect("completion ran"),
            );
        }
        for &(i, ran_at) in &runs {
            let at = deadlines[i as usize];
            assert!(ran_at >= at, "#{i} ran at {ran_at}, due {at}");
        }
        // Deadline order; ties in hand-in order.
        let keys: Vec<(u64, u64)> = runs
            .iter()
            .map(|&(i, _)| (deadlines[i as usize], i))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(keys, sorted);
        assert_eq!(dev.stats().pending, 0);
    }

    #[test]
    fn an_earlier_deadline_wakes_the_thread() {
        let clock = Clock::new();
        let dev = EmulatedDevice::start(spec(1, 0), clock).expect("device starts");
        let (tx, rx) = mpsc::channel();
        let far = tx.clone();
        dev.complete_at(
            clock.now_ns() + 3_600_000_000_000,
            Box::new(move || {
                let _ = far.send("far");
            }),
        );
        // A deadline in the past runs at once, ahead of the far one.
        dev.complete_at(
            0,
            Box::new(move || {
                let _ = tx.send("now");
            }),
        );
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)), Ok("now"));
        assert_eq!(dev.stats().pending, 1);
    }

    #[test]
    fn dropping_the_device_runs_pending_completions() {
        let clock = Clock::new();
        let dev = EmulatedDevice::start(spec(2, 0), clock).expect("device starts");
        let (tx, rx) = mpsc::channel();
        let hour = clock.now_ns() + 3_600_000_000_000;
        for i in 0..10u32 {
            let tx = tx.clone();
            dev.complete_at(
                hour + u64::from(i),
                Box::new(move || {
                    let _ = tx.send(i);
                }),
            );
        }
        assert_eq!(dev.stats().pending, 10);
        drop(dev);
        // Drop joined the thread, so every completion has run, in order.
        let got: Vec<u32> = rx.try_iter().collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_completion_may_drop_the_last_reference() {
        let dev = device(1, 0);
        let (tx, rx) = mpsc::channel();
        let held = Arc::clone(&dev);
        dev.complete_at(
            0,
            Box::new(move || {
                drop(held);
                let _ = tx.send(());
            }),
        );
        // Whichever of the two drops is last: no deadlock, no lost completion.
        drop(dev);
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)), Ok(()));
    }

    #[test]
    fn a_panicking_completion_does_not_lose_the_others() {
        let dev = device(1, 0);
        let (tx, rx) = mpsc::channel();
        dev.complete_at(0, Box::new(|| panic!("boom")));
        dev.complete_at(
            0,
            Box::new(move || {
                let _ = tx.send(());
            }),
        );
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)), Ok(()));
    }

    #[test]
    fn validate_names_the_bad_key() {
        assert!(spec(4, 500).validate().is_ok());
        let mut s = spec(0, 0);
        let err = s.validate().expect_err("parallelism 0").to_string();
        assert!(err.contains("parallelism") && err.contains('0'), "{err}");
        s.parallelism = 1025;
        let err = s.validate().expect_err("parallelism 1025").to_string();
        assert!(err.contains("parallelism") && err.contains("1025"), "{err}");
        let mut s = spec(4, 0);
        s.model.wrandiops = 0;
        let err = s.validate().expect_err("zero rate").to_string();
        assert!(err.contains("model.wrandiops"), "{err}");
        let s = spec(4, 10_001);
        let err = s.validate().expect_err("interference").to_string();
        assert!(err.contains("write_interference_permille"), "{err}");
        assert!(matches!(
            EmulatedDevice::start(spec(0, 0), Clock::new()),
            Err(EmulatedError::Invalid {
                key: "parallelism",
                ..
            })
        ));
    }

    /// A flash-like curve (libra-vop.toml's, in bytes): non-linear in size.
    fn curve() -> VopCurve {
        VopCurve {
            max_iops: 100_000,
            read: vec![
                (1 << 10, 100_000),
                (4 << 10, 90_000),
                (16 << 10, 38_000),
                (64 << 10, 10_500),
                (256 << 10, 2_600),
            ],
            write: vec![
                (1 << 10, 40_000),
                (4 << 10, 34_000),
                (16 << 10, 14_000),
                (64 << 10, 4_100),
                (256 << 10, 1_050),
            ],
        }
    }

    fn curve_device(parallelism: u32) -> Arc<EmulatedDevice> {
        EmulatedDevice::start_with_curve(spec(parallelism, 0), Some(curve()), Clock::new())
            .expect("device starts")
    }

    #[test]
    fn a_curve_device_costs_what_the_curve_says_not_the_linear_model() {
        let dev = curve_device(4);
        // At the curve's points: 10^9 / achieved IOPS, rounded up.
        assert_eq!(dev.cost_ns(OpKind::Read, KIB4, false), 11_112);
        assert_eq!(dev.cost_ns(OpKind::Read, 64 << 10, true), 95_239);
        assert_eq!(dev.cost_ns(OpKind::Write, 256 << 10, false), 952_381);
        // Between points: interpolated IOPS (10 KiB read: half way from 90,000 to 38,000).
        assert_eq!(
            dev.cost_ns(OpKind::Read, 10 << 10, false),
            1_000_000_000u64.div_ceil(64_000)
        );
        // Past the last point: constant bandwidth (512 KiB read = two 256 KiB reads).
        assert_eq!(dev.cost_ns(OpKind::Read, 512 << 10, false), 769_231);
        // Flush, trim, write-zeroes: one 4 KiB write of the write curve.
        assert_eq!(dev.cost_ns(OpKind::Flush, 0, false), 29_412);
        assert_eq!(dev.cost_ns(OpKind::WriteZeroes, 1 << 30, false), 29_412);
        // Non-linear: 64 x the bytes of a 4 KiB read costs only 34.6 x as much.
        let ratio = dev.cost_ns(OpKind::Read, 256 << 10, false) as f64
            / dev.cost_ns(OpKind::Read, KIB4, false) as f64;
        assert!((34.0..35.0).contains(&ratio), "{ratio}");
        // The linear model of the same spec would say otherwise.
        assert_ne!(
            dev.spec().cost_ns(OpKind::Read, KIB4, false),
            dev.cost_ns(OpKind::Read, KIB4, false)
        );
        assert_eq!(dev.service_ns(OpKind::Read, KIB4, false), 4 * 11_112);
        // The same device without a curve is the linear model, unchanged.
        let linear = device(4, 0);
        assert!(linear.curve().is_none());
        assert_eq!(linear.cost_ns(OpKind::Read, KIB4, false), 50_000);
    }

    #[test]
    fn a_curve_device_and_the_vop_scheduler_charge_agree() {
        // The scheduler's qos.cost.device.vop charge of the same curve, as a fraction of its
        // capacity (max_iops x 1000 milli-VOPs per second), equals the device's service as a
        // fraction of a second, up to less than one milli-VOP of rounding.
        let c = curve();
        for op in [OpKind::Read, OpKind::Write] {
            for len in [
                512u32,
                1 << 10,
                4 << 10,
                7 << 10,
                16 << 10,
                100 << 10,
                256 << 10,
                1 << 20,
            ] {
                let device_s = curve_cost_ns(&c, op, len) as f64 / 1e9;
                let charged = c.cost_milli_vops(op, u64::from(len));
                let scheduler_s = charged as f64 / (c.max_iops as f64 * 1000.0);
                let one_mvop = 1.0 / (c.max_iops as f64 * 1000.0);
                assert!(
                    (device_s - scheduler_s).abs() <= one_mvop + 1e-9,
                    "{op:?} {len}: device {device_s} s, scheduler {scheduler_s} s"
                );
            }
        }
    }

    #[test]
    fn saturated_curve_device_finishes_at_the_curves_rate() {
        // 64 KiB reads at QD 400 on 4 channels: 10,500 per second of virtual time.
        let dev = curve_device(4);
        let ends: Vec<u64> = (0..400)
            .map(|_| dev.book(0, OpKind::Read, 0, 64 << 10, false))
            .collect();
        let last = *ends.iter().max().expect("ends");
        let rate = 400.0 / (last as f64 / 1e9);
        assert!((rate - 10_500.0).abs() < 10.0, "{rate}");
        let stats = dev.stats();
        assert_eq!(stats.booked, 400);
        assert_eq!(stats.busy_ns, 400 * 4 * 95_239);
    }

    #[test]
    fn bad_curves_are_rejected_with_the_key() {
        let start = |c: VopCurve| {
            EmulatedDevice::start_with_curve(spec(4, 0), Some(c), Clock::new())
                .expect_err("rejected")
                .to_string()
        };
        let mut c = curve();
        c.max_iops = 0;
        assert!(start(c).contains("curve.max_iops"));
        let mut c = curve();
        c.read.clear();
        let err = start(c);
        assert!(
            err.contains("curve.read") && err.contains("at least one"),
            "{err}"
        );
        let mut c = curve();
        c.write.swap(0, 1);
        let err = start(c);
        assert!(
            err.contains("curve.write") && err.contains("increasing"),
            "{err}"
        );
        let mut c = curve();
        c.write[2].1 = 0;
        let err = start(c);
        assert!(err.contains("curve.write") && err.contains("IOPS"), "{err}");
    }

    #[test]
    fn spec_round_trips_and_rejects_unknown_keys() {
        let s = spec(8, 250);
        let json = serde_json::to_string(&s).expect("serialises");
        let back: EmulatedDeviceSpec = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, s);
        let no_interference = serde_json::json!({
            "model": model(),
            "parallelism": 4,
        });
        let parsed: EmulatedDeviceSpec =
            serde_json::from_value(no_interference).expect("interference defaults");
        assert_eq!(parsed.write_interference_permille, 0);
        let unknown = serde_json::json!({
            "model": model(),
            "parallelism": 4,
            "paralelism": 4,
        });
        assert!(serde_json::from_value::<EmulatedDeviceSpec>(unknown).is_err());
    }
}
