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

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

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
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
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

/// The window, shared by every queue's thread.
#[derive(Clone, Copy, Debug)]
struct Window {
    start: Instant,
    end: Instant,
}

/// Runs `spec` against the device at `spec.socket`.
pub fn run(spec: &VhostLoadSpec) -> Result<VhostLoadReport, VhostLoadError> {
    check(spec)?;
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
    let client = VhostUserBlkClient::connect(
        &spec.socket,
        ClientOptions {
            num_queues: spec.queues,
            queue_size,
            mem_bytes,
            event_idx: true,
            indirect: false,
        },
    )?;
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
    let start = Instant::now();
    let window = Window {
        start: start + spec.ramp,
        end: start + spec.ramp + spec.runtime,
    };
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(q, queue)| {
                let offsets = Offsets {
                    random: spec.pattern.random(),
                    blocks,
                    block_bytes: u64::from(spec.block_bytes),
                    next_block: blocks * q as u64 / u64::from(spec.queues),
                    rng: SplitMix64::new(spec.seed ^ (q as u64).wrapping_mul(0x9e37_79b9)),
                };
                scope.spawn(move || drive(queue, spec, offsets, window))
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
    Ok(())
}

impl QueueCounts {
    /// Nothing counted yet; the histogram (latencies in ns, 1 ns to 60 s, three
    /// significant digits) allocated once here.
    fn new() -> Result<QueueCounts, VhostLoadError> {
        Ok(QueueCounts {
            latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3)
                .map_err(|e| VhostLoadError::Spec(format!("histogram: {e}")))?,
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
        self.latency_ns
            .add(&other.latency_ns)
            .map_err(|e| VhostLoadError::Spec(format!("histogram: {e}")))?;
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
            driver.counts.waits += 1;
            if !driver.queue.wait_call(ANSWER_TIMEOUT_MS)? {
                return Err(VhostUserError::Timeout.into());
            }
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
