//! A closed-loop load generator over vhost-user-blk (`headroom lab vhost-load`): `iodepth`
//! requests kept in flight on each of `queues` virtqueues of one device, random or
//! sequential reads or writes of one size, for a fixed time after a ramp; completions,
//! bytes, latency percentiles (an exact histogram) and every status that is not OK counted.
//!
//! Why built this way (docs/ARCHITECTURE.md decision 68): it must drive any vhost-user-blk
//! backend (Headroom's, qemu-storage-daemon's) as a guest's virtio-blk driver does, so that
//! what it measures is the backend's cost, not an artefact of a client tuned to one of them.
//! So: one connection (one memory table, one set of vrings), each queue driven by a thread of
//! its own (blk-mq's queue per vCPU), chains built over buffers reserved once in the shared
//! memory (nothing allocated or copied per request: a WRITE sends what its buffer already
//! holds), a batch of chains posted per wake-up with one kick and only when the device's
//! `avail_event` asks for it, and completions waited for on the call eventfd with
//! `used_event` re-armed first (EVENT_IDX, when the device offers it). Not done: polling the
//! used ring instead of sleeping on the call eventfd (a driver with `poll_queues`), mixes of
//! sizes or reads and writes, and `lab run` scenarios over vhost-user.
//!
//! Paced (`rate_iops`, `--rate-iops`): the same queues, but each starts its requests on the
//! schedule of [`super::pacing`] (the device's rate shared by its queues, at most `iodepth`
//! in flight, a start due while the queue is full made as soon as a slot frees, never more
//! than `iodepth` starts owed), as fio's `rate_iops` paces a victim below its limit. The
//! latency reported is from a request's actual start (when it was posted) to the wake-up
//! that saw it used, as fio's `clat` is: not from the time it was due, so a queue that falls
//! behind its schedule shows that in `start_lag_*` and `starts_skipped`, not in its latency.
//! Between starts a queue with nothing in flight sleeps to the next one's time; one with
//! requests in flight and a slot free waits on the call eventfd, whose bound is in whole
//! milliseconds, so at `iodepth` > 1 a start may be up to about 1 ms late (the schedule is
//! absolute: the rate holds); at QD1 either the one request is in flight (nothing can start)
//! or none is (a plain sleep), so it is not.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use super::pacing::{Pacer, PacingError, Schedule, Wait};
use super::{
    ANSWER_TIMEOUT_MS, Buffer, ClientOptions, QueueDriver, RINGS_BYTES, Reaped, S_IOERR, S_OK,
    S_UNSUPP, T_IN, T_OUT, VhostUserBlkClient, VhostUserError,
};
use crate::closed_loop::process_cpu_ns;
use crate::rng::SplitMix64;

/// What each request does and where it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    RandRead,
    RandWrite,
    /// Sequential, each queue from its own start (queue `q` at `q / queues` of the range).
    SeqRead,
    SeqWrite,
}

impl Pattern {
    /// fio's names: `randread`, `randwrite`, `read`, `write`.
    pub fn parse(name: &str) -> Option<Pattern> {
        match name {
            "randread" => Some(Pattern::RandRead),
            "randwrite" => Some(Pattern::RandWrite),
            "read" => Some(Pattern::SeqRead),
            "write" => Some(Pattern::SeqWrite),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::SeqRead => "read",
            Pattern::SeqWrite => "write",
        }
    }

    fn writes(self) -> bool {
        matches!(self, Pattern::RandWrite | Pattern::SeqWrite)
    }

    fn random(self) -> bool {
        matches!(self, Pattern::RandRead | Pattern::RandWrite)
    }
}

/// A run of the generator.
#[derive(Clone, Debug)]
pub struct VhostLoadSpec {
    pub socket: PathBuf,
    pub pattern: Pattern,
    pub block_bytes: u32,
    /// Requests kept in flight on each queue.
    pub iodepth: u16,
    pub queues: u16,
    /// The measured window, after the ramp.
    pub runtime: Duration,
    /// Load before the window, not counted in it.
    pub ramp: Duration,
    /// The range of the device addressed, from offset 0 (default: its capacity).
    pub size_bytes: Option<u64>,
    pub seed: u64,
    /// Requests started per second for the device, shared by its queues (`None`: a closed
    /// loop, every slot posted again as soon as it completes).
    pub rate_iops: Option<u64>,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum VhostLoadError {
    #[error("{0}")]
    Spec(String),
    #[error("{0}")]
    Device(#[from] VhostUserError),
    #[error("a queue's thread panicked")]
    Panicked,
    #[error("pacing: {0}")]
    Pacing(#[from] PacingError),
}

/// What a run did. The window's numbers (`completions` to `p999_us`) count what completed
/// inside the measured window; `all_*` count everything from the first request to the last
/// one drained, so they match what the device counted.
#[derive(Clone, Debug, Serialize)]
pub struct VhostLoadReport {
    pub rw: &'static str,
    pub block_bytes: u32,
    pub iodepth: u16,
    pub queues: u16,
    /// Descriptors per queue, as negotiated.
    pub queue_size: u16,
    pub event_idx: bool,
    pub capacity_bytes: u64,
    pub size_bytes: u64,
    pub ramp_s: f64,
    /// The window's measured length.
    pub runtime_s: f64,
    pub completions: u64,
    pub bytes: u64,
    pub iops: f64,
    /// 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Latency in µs, from a request's start (posted) to the wake-up that saw it used.
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    /// The pace asked for (`None`: a closed loop; then the `start*` fields are 0).
    pub rate_iops: Option<u64>,
    /// Starts dropped because more than `iodepth` were owed on a queue (over the whole
    /// run): the device, or the generator, slower than the rate.
    pub starts_skipped: u64,
    /// How late the window's starts were against their due time, µs.
    pub start_lag_p50_us: f64,
    pub start_lag_p99_us: f64,
    pub start_lag_max_us: f64,
    /// Chains used with a status other than OK, over the whole run (any is a failure).
    pub errors: u64,
    pub errors_ioerr: u64,
    pub errors_unsupp: u64,
    /// Any other status byte (a device that returned the chain without writing it leaves
    /// 0xFF there).
    pub errors_other: u64,
    pub all_completions: u64,
    pub all_bytes: u64,
    /// Kicks sent and blocking waits on the call eventfd, over the whole run: with
    /// EVENT_IDX both are fewer than requests when the device batches.
    pub kicks: u64,
    pub waits: u64,
    /// The generator's own CPU (all threads) over the window per completion, and in cores.
    pub generator_cpu_ns_per_io: f64,
    pub generator_cpu_cores: f64,
}

/// One queue's buffers for one request, reserved once.
#[derive(Clone, Copy, Debug)]
struct Slot {
    header_addr: u64,
    data_addr: u64,
    status_addr: u64,
    started: Instant,
}

/// What one queue's thread counted.
#[derive(Debug)]
struct QueueCounts {
    latency_ns: Histogram<u64>,
    /// Paced: each start's lateness against its due time (in the window).
    start_lag_ns: Histogram<u64>,
    starts_skipped: u64,
    completions: u64,
    errors_ioerr: u64,
    errors_unsupp: u64,
    errors_other: u64,
    all_completions: u64,
    kicks: u64,
    waits: u64,
}

/// Where a queue's requests go.
#[derive(Debug)]
struct Offsets {
    random: bool,
    blocks: u64,
    block_bytes: u64,
    next_block: u64,
    rng: SplitMix64,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        let block = if self.random {
            self.rng.below(self.blocks)
        } else {
            let b = self.next_block;
            self.next_block = (b + 1) % self.blocks;
            b
        };
        block * self.block_bytes
    }
}

/// The run's clock, shared by every queue's thread: its origin (the pacing schedule's
/// time 0) and the measured window.
#[derive(Clone, Copy, Debug)]
struct Window {
    origin: Instant,
    start: Instant,
    end: Instant,
}

/// Runs `spec` against the device at `spec.socket`.
pub fn run(spec: &VhostLoadSpec) -> Result<VhostLoadReport, VhostLoadError> {
    check(spec)?;
    let options = client_options(spec)?;
    let queue_size = options.queue_size;
    let client = VhostUserBlkClient::connect(&spec.socket, options)?;
    let event_idx = client.event_idx();
    let capacity_bytes = client.capacity_bytes();
    let size_bytes = spec.size_bytes.unwrap_or(capacity_bytes);
    if size_bytes > capacity_bytes || size_bytes < u64::from(spec.block_bytes) {
        return Err(VhostLoadError::Spec(format!(
            "size {size_bytes} bytes: must be at least the block size ({}) and at most the \
             device's capacity ({capacity_bytes})",
            spec.block_bytes
        )));
    }
    let (connection, queues) = client.into_queues();
    let blocks = size_bytes / u64::from(spec.block_bytes);
    let pacers = pacers(spec)?;
    let start = Instant::now();
    let window = Window {
        origin: start,
        start: start + spec.ramp,
        end: start + spec.ramp + spec.runtime,
    };
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = queues
            .into_iter()
            .zip(pacers)
            .enumerate()
            .map(|(q, (queue, pacer))| {
                let offsets = Offsets {
                    random: spec.pattern.random(),
                    blocks,
                    block_bytes: u64::from(spec.block_bytes),
                    next_block: blocks * q as u64 / u64::from(spec.queues),
                    rng: SplitMix64::new(spec.seed ^ (q as u64).wrapping_mul(0x9e37_79b9)),
                };
                scope.spawn(move || match pacer {
                    Some(pacer) => drive_paced(queue, spec, offsets, window, pacer),
                    None => drive(queue, spec, offsets, window),
                })
            })
            .collect();
        // The generator's own CPU over the window: read at its edges (a pace, not a
        // synchronisation: the queues' threads keep their own clock).
        std::thread::sleep(window.start.saturating_duration_since(Instant::now()));
        let cpu_start = process_cpu_ns();
        let measured_from = Instant::now();
        std::thread::sleep(window.end.saturating_duration_since(Instant::now()));
        let cpu_ns = process_cpu_ns().saturating_sub(cpu_start);
        let measured_s = measured_from.elapsed().as_secs_f64();
        let counts: Vec<Result<QueueCounts, VhostLoadError>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Err(VhostLoadError::Panicked)))
            .collect();
        (counts, cpu_ns, measured_s)
    });
    let (counts, cpu_ns, measured_s) = results;
    let mut t = QueueCounts::new()?;
    for c in counts {
        t.merge(&c?)?;
    }
    connection.disconnect()?;
    let runtime_s = spec.runtime.as_secs_f64();
    let bytes = t.completions * u64::from(spec.block_bytes);
    let us = |q: f64| t.latency_ns.value_at_quantile(q) as f64 / 1000.0;
    let lag_us = |q: f64| t.start_lag_ns.value_at_quantile(q) as f64 / 1000.0;
    let errors = t.errors_ioerr + t.errors_unsupp + t.errors_other;
    Ok(VhostLoadReport {
        rw: spec.pattern.name(),
        block_bytes: spec.block_bytes,
        iodepth: spec.iodepth,
        queues: spec.queues,
        queue_size,
        event_idx,
        capacity_bytes,
        size_bytes,
        ramp_s: spec.ramp.as_secs_f64(),
        runtime_s,
        completions: t.completions,
        bytes,
        iops: t.completions as f64 / runtime_s,
        mb_per_s: bytes as f64 / runtime_s / 1e6,
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        max_us: t.latency_ns.max() as f64 / 1000.0,
        mean_us: t.latency_ns.mean() / 1000.0,
        rate_iops: spec.rate_iops,
        starts_skipped: t.starts_skipped,
        start_lag_p50_us: lag_us(0.5),
        start_lag_p99_us: lag_us(0.99),
        start_lag_max_us: t.start_lag_ns.max() as f64 / 1000.0,
        errors,
        errors_ioerr: t.errors_ioerr,
        errors_unsupp: t.errors_unsupp,
        errors_other: t.errors_other,
        all_completions: t.all_completions,
        all_bytes: (t.all_completions - errors) * u64::from(spec.block_bytes),
        kicks: t.kicks,
        waits: t.waits,
        generator_cpu_ns_per_io: cpu_ns as f64 / t.completions.max(1) as f64,
        generator_cpu_cores: cpu_ns as f64 / 1e9 / measured_s.max(1e-9),
    })
}

/// The connection `spec` needs: its queues, each of the size `iodepth` chains of 3
/// descriptors take (the next power of two, at least 128), and memory for the rings and
/// every slot's buffers.
fn client_options(spec: &VhostLoadSpec) -> Result<ClientOptions, VhostLoadError> {
    let descriptors = 3 * u32::from(spec.iodepth);
    let queue_size = descriptors.next_power_of_two().max(128);
    let queue_size = u16::try_from(queue_size)
        .ok()
        .filter(|s| *s <= 1024)
        .ok_or_else(|| {
            VhostLoadError::Spec(format!(
                "iodepth {} needs {descriptors} descriptors per queue; at most 1024",
                spec.iodepth
            ))
        })?;
    let per_request_bytes = u64::from(spec.block_bytes) + 192;
    let arena_bytes = u64::from(spec.iodepth) * per_request_bytes + (64 << 10);
    let mem_bytes = (RINGS_BYTES + u64::from(spec.queues) * arena_bytes).next_multiple_of(2 << 20);
    Ok(ClientOptions {
        num_queues: spec.queues,
        queue_size,
        mem_bytes,
        event_idx: true,
        indirect: false,
    })
}

/// Each queue's pacer (none for a closed loop).
fn pacers(spec: &VhostLoadSpec) -> Result<Vec<Option<Pacer>>, VhostLoadError> {
    (0..spec.queues)
        .map(|q| match spec.rate_iops {
            Some(rate) => Ok(Some(Pacer::new(
                Schedule::new(rate, spec.queues, q)?,
                spec.iodepth,
            )?)),
            None => Ok(None),
        })
        .collect()
}

fn check(spec: &VhostLoadSpec) -> Result<(), VhostLoadError> {
    let refuse = |why: String| Err(VhostLoadError::Spec(why));
    if spec.block_bytes == 0 || !spec.block_bytes.is_multiple_of(512) {
        return refuse(format!(
            "block size {} bytes: must be a positive multiple of 512",
            spec.block_bytes
        ));
    }
    if spec.iodepth == 0 {
        return refuse("iodepth must be at least 1".into());
    }
    if spec.queues == 0 || spec.queues > 64 {
        return refuse(format!("queues {}: 1 to 64", spec.queues));
    }
    if spec.runtime.is_zero() {
        return refuse("the runtime must be positive".into());
    }
    if spec.rate_iops == Some(0) {
        return refuse("the rate must be at least 1 IOPS (none: a closed loop)".into());
    }
    Ok(())
}

impl QueueCounts {
    /// Nothing counted yet; the histogram (latencies in ns, 1 ns to 60 s, three
    /// significant digits) allocated once here.
    fn new() -> Result<QueueCounts, VhostLoadError> {
        let histogram = || {
            Histogram::new_with_bounds(1, 60_000_000_000, 3)
                .map_err(|e| VhostLoadError::Spec(format!("histogram: {e}")))
        };
        Ok(QueueCounts {
            latency_ns: histogram()?,
            start_lag_ns: histogram()?,
            starts_skipped: 0,
            completions: 0,
            errors_ioerr: 0,
            errors_unsupp: 0,
            errors_other: 0,
            all_completions: 0,
            kicks: 0,
            waits: 0,
        })
    }

    fn merge(&mut self, other: &QueueCounts) -> Result<(), VhostLoadError> {
        for (mine, theirs) in [
            (&mut self.latency_ns, &other.latency_ns),
            (&mut self.start_lag_ns, &other.start_lag_ns),
        ] {
            mine.add(theirs)
                .map_err(|e| VhostLoadError::Spec(format!("histogram: {e}")))?;
        }
        self.starts_skipped += other.starts_skipped;
        self.completions += other.completions;
        self.errors_ioerr += other.errors_ioerr;
        self.errors_unsupp += other.errors_unsupp;
        self.errors_other += other.errors_other;
        self.all_completions += other.all_completions;
        self.kicks += other.kicks;
        self.waits += other.waits;
        Ok(())
    }
}

/// One queue's closed loop: every slot in flight, each used one counted and posted again
/// (with a fresh offset) until the window ends, then the rest drained.
fn drive(
    queue: QueueDriver,
    spec: &VhostLoadSpec,
    offsets: Offsets,
    window: Window,
) -> Result<QueueCounts, VhostLoadError> {
    let mut driver = QueueLoop::new(queue, spec, offsets)?;
    let now = Instant::now();
    for i in 0..driver.slots.len() {
        driver.post(i, now)?;
    }
    driver.kick()?;
    let mut reaped: Vec<Reaped> = Vec::with_capacity(usize::from(driver.queue.size()));
    loop {
        reaped.clear();
        driver.queue.reap(&mut reaped)?;
        if reaped.is_empty() {
            if driver.queue.in_flight() == 0 {
                return Ok(driver.counts);
            }
            driver.wait_for_answers()?;
            continue;
        }
        let now = Instant::now();
        let stopping = now >= window.end;
        for r in &reaped {
            let i = driver.complete(r, now, now >= window.start && !stopping)?;
            if !stopping {
                driver.post(i, now)?;
            }
        }
        if !stopping {
            driver.kick()?;
        }
    }
}

/// One queue paced by `pacer` (module comment): requests started when the schedule says, on
/// slots free, until the window ends; then the rest drained.
fn drive_paced(
    queue: QueueDriver,
    spec: &VhostLoadSpec,
    offsets: Offsets,
    window: Window,
    mut pacer: Pacer,
) -> Result<QueueCounts, VhostLoadError> {
    let mut driver = QueueLoop::new(queue, spec, offsets)?;
    let mut free: Vec<usize> = (0..driver.slots.len()).rev().collect();
    let mut reaped: Vec<Reaped> = Vec::with_capacity(usize::from(driver.queue.size()));
    loop {
        reaped.clear();
        driver.queue.reap(&mut reaped)?;
        let now = Instant::now();
        let stopping = now >= window.end;
        for r in &reaped {
            free.push(driver.complete(r, now, now >= window.start && !stopping)?);
        }
        if stopping {
            driver.counts.starts_skipped = pacer.skipped();
            if driver.queue.in_flight() == 0 {
                return Ok(driver.counts);
            }
            driver.wait_for_answers()?;
            continue;
        }
        // in_flight <= iodepth <= u16::MAX.
        let in_flight = driver.queue.in_flight() as u16;
        let step = pacer.poll(ns_since(window.origin, now), in_flight);
        if step.count > 0 {
            let posted = Instant::now();
            let posted_ns = ns_since(window.origin, posted);
            for k in step.first..step.first + u64::from(step.count) {
                let i = free
                    .pop()
                    .ok_or(VhostUserError::Protocol("no free slot for a paced start"))?;
                driver.post(i, posted)?;
                if posted >= window.start {
                    let lag_ns = posted_ns.saturating_sub(pacer.schedule().due_ns(k));
                    driver.counts.start_lag_ns.saturating_record(lag_ns.max(1));
                }
            }
            driver.kick()?;
        }
        let until = |due_ns: u64| {
            let due = window.origin + Duration::from_nanos(due_ns);
            due.min(window.end)
        };
        match step.wait {
            Wait::Completion => {
                driver.counts.waits += 1;
                if !driver.queue.wait_call(ANSWER_TIMEOUT_MS)? {
                    return Err(VhostUserError::Timeout.into());
                }
            }
            // Nothing in flight: nothing can complete before the next start (a pace, the
            // schedule's, not a synchronisation).
            Wait::Until(due_ns) => {
                std::thread::sleep(until(due_ns).saturating_duration_since(Instant::now()));
            }
            // A completion or the next start: the call eventfd's bound is in whole ms, so
            // rounded up (the start may go late, a completion is seen when it comes).
            Wait::CompletionOrUntil(due_ns) => {
                let left = until(due_ns).saturating_duration_since(Instant::now());
                if !left.is_zero() {
                    driver.counts.waits += 1;
                    let ms = left.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128);
                    driver.queue.wait_call(ms as i32)?;
                }
            }
        }
    }
}

/// `at` in ns after `origin` (0 before it).
fn ns_since(origin: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX)
}

/// One queue's state while it is driven: its slots (a request's buffers each) and which slot
/// each chain in flight is.
struct QueueLoop {
    queue: QueueDriver,
    slots: Vec<Slot>,
    /// By head: the slot of the chain in flight (u16::MAX: none).
    slot_of_head: Vec<u16>,
    offsets: Offsets,
    writes: bool,
    block_bytes: u32,
    counts: QueueCounts,
}

impl QueueLoop {
    /// Sleeps on the call eventfd until the device answers something (counted as a wait);
    /// an error if nothing comes within the answer timeout.
    fn wait_for_answers(&mut self) -> Result<(), VhostLoadError> {
        self.counts.waits += 1;
        if !self.queue.wait_call(ANSWER_TIMEOUT_MS)? {
            return Err(VhostUserError::Timeout.into());
        }
        Ok(())
    }

    /// Reserves every slot's header, status and data in the queue's memory, a WRITE's data
    /// filled once with random bytes (what every WRITE of the slot sends).
    fn new(
        mut queue: QueueDriver,
        spec: &VhostLoadSpec,
        mut offsets: Offsets,
    ) -> Result<QueueLoop, VhostLoadError> {
        let writes = spec.pattern.writes();
        let block_bytes = spec.block_bytes;
        let now = Instant::now();
        let mut slots = Vec::with_capacity(usize::from(spec.iodepth));
        let mut fill = vec![0u8; block_bytes as usize];
        let mut rng = SplitMix64::new(offsets.rng.next_u64());
        for _ in 0..spec.iodepth {
            let header_addr = queue.reserve(16)?;
            let status_addr = queue.reserve(1)?;
            let data_addr = queue.reserve(block_bytes)?;
            if writes {
                for chunk in fill.chunks_mut(8) {
                    let bytes = rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&bytes[..chunk.len()]);
                }
                queue.write_mem(data_addr, &fill)?;
            }
            slots.push(Slot {
                header_addr,
                data_addr,
                status_addr,
                started: now,
            });
        }
        let slot_of_head = vec![u16::MAX; usize::from(queue.size())];
        Ok(QueueLoop {
            queue,
            slots,
            slot_of_head,
            offsets,
            writes,
            block_bytes,
            counts: QueueCounts::new()?,
        })
    }

    /// Posts slot `i`'s request at a fresh offset (not kicked).
    fn post(&mut self, i: usize, now: Instant) -> Result<(), VhostUserError> {
        let request_type = if self.writes { T_OUT } else { T_IN };
        let slot = &mut self.slots[i];
        self.queue
            .write_header(slot.header_addr, request_type, self.offsets.next() / 512)?;
        let buffers = [
            Buffer {
                addr: slot.header_addr,
                len: 16,
                device_writes: false,
            },
            Buffer {
                addr: slot.data_addr,
                len: self.block_bytes,
                device_writes: !self.writes,
            },
            Buffer {
                addr: slot.status_addr,
                len: 1,
                device_writes: true,
            },
        ];
        let head = self.queue.post_chain(&buffers, slot.status_addr)?;
        // i < iodepth <= u16::MAX.
        self.slot_of_head[usize::from(head)] = i as u16;
        slot.started = now;
        Ok(())
    }

    fn kick(&mut self) -> Result<(), VhostUserError> {
        if self.queue.kick()? {
            self.counts.kicks += 1;
        }
        Ok(())
    }

    /// Counts a used chain (in the window's figures if `in_window`, as fio counts after its
    /// ramp, its latency with it); its slot, free again.
    fn complete(
        &mut self,
        r: &Reaped,
        now: Instant,
        in_window: bool,
    ) -> Result<usize, VhostUserError> {
        let i = usize::from(
            *self
                .slot_of_head
                .get(usize::from(r.head))
                .filter(|i| **i != u16::MAX)
                .ok_or(VhostUserError::Protocol("a used chain not submitted"))?,
        );
        self.slot_of_head[usize::from(r.head)] = u16::MAX;
        let counts = &mut self.counts;
        counts.all_completions += 1;
        match r.status {
            S_OK => {
                if in_window {
                    let ns = now.duration_since(self.slots[i].started).as_nanos();
                    counts
                        .latency_ns
                        .saturating_record(u64::try_from(ns).unwrap_or(u64::MAX));
                    counts.completions += 1;
                }
            }
            S_IOERR => counts.errors_ioerr += 1,
            S_UNSUPP => counts.errors_unsupp += 1,
            _ => counts.errors_other += 1,
        }
        Ok(i)
    }
}
