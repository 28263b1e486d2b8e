//! Many tenants from one process: every tenant of every group on its own connection, closed
//! or open loop, for a fixed time, with exact per-group latency histograms and a timeline.
//!
//! Why this shape:
//! * **One task per tenant, one connection each.** The server schedules per volume and per
//!   connection; sharing a connection between tenants would add head-of-line blocking the
//!   scenario does not have. A tenant's submitter and its reply reader are two tasks on one
//!   split socket, so replies are drained while the submitter waits for the next arrival.
//! * **Latency from the send to the reply**, timestamped by the reader as soon as a reply
//!   header (and a READ's data) is in: the latency the tenant sees. An open-loop arrival that
//!   waits for a free slot (its backlog) waits *before* the send, as in the simulator, so the
//!   backlog's wait is not in the latency; `dropped` counts arrivals beyond the backlog cap.
//! * **Timer granularity.** Tokio's timer has millisecond resolution, so an open-loop tenant
//!   wakes at most about once a millisecond and sends every arrival due by then: the rate
//!   and the arrival count are exact, arrivals closer than ~1 ms go out together. A victim
//!   at 1,000 IOPS or less is unaffected; a fast Poisson tenant is slightly burstier.
//! * **Exact counts.** At the end the tenants stop issuing and wait for every request in
//!   flight, so the totals are what the server executed (the lab's test checks them against
//!   the server's counters); statistics only count completions inside the group's window.
//! * **Own cost.** The process CPU time over the run (`CLOCK_PROCESS_CPUTIME_ID`) divided by
//!   the I/Os completed tells whether the generator, not the server, could be the limit.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use headroom_nbd::consts::{NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE};
use headroom_nbd::{RequestHeader, encode_request_header};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::arrival::Arrivals;
use crate::client::{LabError, NbdClient};
use crate::closed_loop::process_cpu_ns;
use crate::load::{GroupLoad, LoadMode, MAX_BACKLOG, RunPlan, SECTOR_BYTES, TenantLoad};
use crate::replies::{READ_BIT, read_replies};
use crate::rng::SplitMix64;

/// Latencies above one hour are clamped to it (the histogram's upper bound).
const MAX_LATENCY_US: u64 = 3_600_000_000;
/// Cookie layout: bit 0 = READ (`replies::READ_BIT`), bits 1..24 = length in sectors, bits 24.. = sequence. The
/// reader learns from the cookie alone how much data follows a READ's reply.
const SECTORS_SHIFT: u32 = 1;
const SECTORS_MASK: u64 = (1 << 23) - 1;
const SEQ_SHIFT: u32 = 24;
/// Offsets of random I/O are aligned to this (or to the request size, if smaller).
const ALIGN_BYTES: u64 = 4096;

/// One timeline bucket of a group: completions in it (errors included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Completed I/Os.
    pub ios: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Sum of their latencies, µs.
    pub latency_sum_us: u64,
}

/// What a group did.
#[derive(Debug, Clone)]
pub struct GroupOutcome {
    /// Group name.
    pub name: String,
    /// Tenants (connections).
    pub tenants: usize,
    /// Length of the statistics window.
    pub window: Duration,
    /// I/Os completed in the window (errors included).
    pub ios: u64,
    /// Their payload bytes.
    pub bytes: u64,
    /// Latency of each of them, µs.
    pub latency_us: Histogram<u64>,
    /// Timeline over the whole run, one bucket per `RunPlan::timeline_bucket`.
    pub timeline: Vec<Bucket>,
    /// Successful READs over the whole run (warm-up and drain included).
    pub total_reads: u64,
    /// Successful WRITEs over the whole run.
    pub total_writes: u64,
    /// Bytes of those READs.
    pub total_read_bytes: u64,
    /// Bytes of those WRITEs.
    pub total_write_bytes: u64,
    /// I/Os the server answered with an error (whole run).
    pub errors: u64,
    /// Open-loop arrivals dropped because the backlog was full.
    pub dropped: u64,
    /// Open-loop arrivals still waiting in the backlog when the run ended (never sent).
    pub unsent: u64,
}

impl GroupOutcome {
    /// I/Os per second in the window.
    #[must_use]
    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// Payload bytes per second in the window.
    #[must_use]
    pub fn bytes_per_s(&self) -> f64 {
        self.bytes as f64 / self.window.as_secs_f64().max(1e-9)
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Per group, in the order given.
    pub groups: Vec<GroupOutcome>,
    /// From the start to the last reply of the drain.
    pub elapsed: Duration,
    /// CPU time of this process over the run, ns.
    pub cpu_ns: u64,
}

impl RunOutcome {
    /// Every completion of the run.
    #[must_use]
    pub fn completed(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| g.total_reads + g.total_writes + g.errors)
            .sum()
    }

    /// The generator's CPU per completed I/O, ns (0 for an empty run).
    #[must_use]
    pub fn cpu_ns_per_io(&self) -> f64 {
        match self.completed() {
            0 => 0.0,
            n => self.cpu_ns as f64 / n as f64,
        }
    }
}

/// Per-tenant results before merging into the group.
struct TenantOutcome {
    group: GroupOutcome,
}

/// Runs every group's tenants together for `plan.duration`, then drains. `progress`, if
/// given, is called about five times a second with the fraction of the duration elapsed.
///
/// Every tenant is validated and connected before the clock starts, so a bad spec or an
/// unreachable export fails the run before any load is sent.
pub async fn run(
    groups: &[GroupLoad],
    plan: RunPlan,
    progress: Option<Box<dyn Fn(f64) + Send + Sync>>,
) -> Result<RunOutcome, LabError> {
    if plan.duration.is_zero() || plan.timeline_bucket.is_zero() {
        return Err(LabError::InvalidSpec(
            "the run's duration and timeline bucket must be positive".into(),
        ));
    }
    let mut connected = Vec::new();
    for (gi, group) in groups.iter().enumerate() {
        for (ti, tenant) in group.tenants.iter().enumerate() {
            let context = |e: LabError| LabError::Tenant {
                group: group.name.clone(),
                tenant: ti,
                source: Box::new(e),
            };
            tenant.validate().map_err(context)?;
            let client = NbdClient::connect(&tenant.target.addr, &tenant.target.export)
                .await
                .map_err(context)?;
            let export = client.export();
            if tenant.region_bytes > export.size_bytes {
                return Err(context(LabError::RegionTooLarge {
                    region_bytes: tenant.region_bytes,
                    export_bytes: export.size_bytes,
                }));
            }
            if export.read_only() && tenant.read_permille < 1000 {
                return Err(context(LabError::ReadOnlyExport));
            }
            connected.push((gi, ti, client));
        }
    }
    let buckets = usize::try_from(
        plan.duration
            .as_nanos()
            .div_ceil(plan.timeline_bucket.as_nanos().max(1)),
    )
    .unwrap_or(usize::MAX)
    .min(10_000_000);
    let cpu_start = process_cpu_ns();
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (gi, ti, client) in connected {
        let group = &groups[gi];
        let tenant = group.tenants[ti].clone();
        let window = (group.stats_from, group.stats_to.min(plan.duration));
        let name = group.name.clone();
        tasks.spawn(async move {
            let result = drive(client, tenant, start, plan, window, buckets, &name).await;
            (gi, ti, name, result)
        });
    }
    let ticker = progress.map(|report| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                report((start.elapsed().as_secs_f64() / plan.duration.as_secs_f64()).min(1.0));
            }
        })
    });
    let mut merged: Vec<GroupOutcome> = groups
        .iter()
        .map(|g| {
            empty_outcome(
                &g.name,
                0,
                g.stats_from,
                g.stats_to.min(plan.duration),
                buckets,
            )
        })
        .collect::<Result<_, _>>()?;
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((gi, _, _, Ok(outcome))) => merge(&mut merged[gi], &outcome.group)?,
            Ok((_, ti, group, Err(e))) => {
                if failure.is_none() {
                    failure = Some(LabError::Tenant {
                        group,
                        tenant: ti,
                        source: Box::new(e),
                    });
                    tasks.abort_all();
                }
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                failure.get_or_insert(LabError::InvalidSpec(format!("a tenant task failed: {e}")));
            }
        }
    }
    if let Some(ticker) = ticker {
        ticker.abort();
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let elapsed = start.elapsed();
    let cpu_ns = process_cpu_ns().saturating_sub(cpu_start);
    Ok(RunOutcome {
        groups: merged,
        elapsed,
        cpu_ns,
    })
}

fn new_histogram() -> Result<Histogram<u64>, LabError> {
    Histogram::<u64>::new_with_bounds(1, MAX_LATENCY_US, 3)
        .map_err(|e| LabError::InvalidSpec(format!("latency histogram: {e}")))
}

fn empty_outcome(
    name: &str,
    tenants: usize,
    from: Duration,
    to: Duration,
    buckets: usize,
) -> Result<GroupOutcome, LabError> {
    Ok(GroupOutcome {
        name: name.to_string(),
        tenants,
        window: to.saturating_sub(from),
        ios: 0,
        bytes: 0,
        latency_us: new_histogram()?,
        timeline: vec![Bucket::default(); buckets],
        total_reads: 0,
        total_writes: 0,
        total_read_bytes: 0,
        total_write_bytes: 0,
        errors: 0,
        dropped: 0,
        unsent: 0,
    })
}

fn merge(into: &mut GroupOutcome, from: &GroupOutcome) -> Result<(), LabError> {
    into.tenants += from.tenants;
    into.ios += from.ios;
    into.bytes += from.bytes;
    into.latency_us
        .add(&from.latency_us)
        .map_err(|e| LabError::InvalidSpec(format!("merging histograms: {e}")))?;
    for (a, b) in into.timeline.iter_mut().zip(&from.timeline) {
        a.ios += b.ios;
        a.bytes += b.bytes;
        a.latency_sum_us += b.latency_sum_us;
    }
    into.total_reads += from.total_reads;
    into.total_writes += from.total_writes;
    into.total_read_bytes += from.total_read_bytes;
    into.total_write_bytes += from.total_write_bytes;
    into.errors += from.errors;
    into.dropped += from.dropped;
    into.unsent += from.unsent;
    Ok(())
}

/// One tenant's loop: issue while on and before the end, record every reply, drain, DISC.
async fn drive(
    client: NbdClient,
    load: TenantLoad,
    start: Instant,
    plan: RunPlan,
    (stats_from, stats_to): (Duration, Duration),
    buckets: usize,
    name: &str,
) -> Result<TenantOutcome, LabError> {
    let mut out_stats = empty_outcome(name, 1, stats_from, stats_to, buckets)?;
    let end = start + plan.duration;
    let give_up = end + plan.drain_timeout;
    let mut rng = SplitMix64::new(load.seed);
    let mut arrivals = match load.mode {
        LoadMode::Open {
            rate_iops, arrival, ..
        } => Some(Arrivals::new(
            arrival,
            rate_iops,
            load.seed ^ 0xa5a5_5a5a_0f0f_f0f0,
        )),
        LoadMode::Closed { .. } => None,
    };
    let mut next_arrival = arrivals
        .as_mut()
        .map(|a| start + Duration::from_nanos(a.next_gap_ns()));
    let cap = load.max_in_flight() as usize;
    let max_bytes = load.sizes.max_bytes();
    // Pseudo-random data (not zeroes, which a store could short-cut), written by every WRITE.
    let mut payload = Vec::with_capacity(max_bytes as usize + 8);
    while payload.len() < max_bytes as usize {
        payload.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    payload.truncate(max_bytes as usize);

    let (read_half, mut writer) = client.into_stream().into_split();
    let (tx, mut rx) = mpsc::channel(cap + 16);
    let reader = tokio::spawn(read_replies(read_half, max_bytes, tx, |cookie| {
        let sectors = (cookie >> SECTORS_SHIFT) & SECTORS_MASK;
        usize::try_from(sectors * u64::from(SECTOR_BYTES)).unwrap_or(usize::MAX)
    }));
    let result = async {
        let mut in_flight: HashMap<u64, (Instant, u32)> = HashMap::with_capacity(cap);
        let mut out = Vec::with_capacity(256 * 1024);
        let mut seq = 0u64;
        let mut cursor = 0u64;
        let mut backlog = 0u64;
        let closed = matches!(load.mode, LoadMode::Closed { .. });
        let bucket_ns = plan.timeline_bucket.as_nanos().max(1);
        loop {
            let now = Instant::now();
            let running = now < end;
            if let (Some(at), Some(arrivals)) = (next_arrival.as_mut(), arrivals.as_mut()) {
                while *at <= now && *at < end {
                    if load.phases.is_on(ns_since(start, *at)) {
                        if backlog < MAX_BACKLOG {
                            backlog += 1;
                        } else {
                            out_stats.dropped += 1;
                        }
                    }
                    *at += Duration::from_nanos(arrivals.next_gap_ns());
                }
            }
            out.clear();
            if running && load.phases.is_on(ns_since(start, now)) {
                while in_flight.len() < cap && (closed || backlog > 0) {
                    let read = rng.below(1000) < u64::from(load.read_permille);
                    let size = load.sizes.sample(&mut rng);
                    let offset = if load.sequential {
                        if cursor + u64::from(size) > load.region_bytes {
                            cursor = 0;
                        }
                        let at = cursor;
                        cursor += u64::from(size);
                        at
                    } else {
                        let align = ALIGN_BYTES.min(u64::from(size)).max(u64::from(SECTOR_BYTES));
                        let slots = (load.region_bytes - u64::from(size)) / align + 1;
                        rng.below(slots) * align
                    };
                    let sectors = u64::from(size / SECTOR_BYTES);
                    let cookie = (seq << SEQ_SHIFT)
                        | (sectors << SECTORS_SHIFT)
                        | if read { READ_BIT } else { 0 };
                    seq += 1;
                    encode_request_header(
                        &mut out,
                        &RequestHeader {
                            flags: 0,
                            command: if read { NBD_CMD_READ } else { NBD_CMD_WRITE },
                            cookie,
                            offset,
                            length: size,
                        },
                    );
                    if !read {
                        out.extend_from_slice(&payload[..size as usize]);
                    }
                    in_flight.insert(cookie, (Instant::now(), size));
                    if !closed {
                        backlog -= 1;
                    }
                }
            }
            if !out.is_empty() {
                writer
                    .write_all(&out)
                    .await
                    .map_err(LabError::io("sending requests"))?;
            }
            if !running && in_flight.is_empty() {
                break;
            }
            if now >= give_up {
                return Err(LabError::DrainTimeout {
                    in_flight: in_flight.len(),
                    after: plan.drain_timeout,
                });
            }
            let mut wake = if running { end } else { give_up };
            if running {
                if let Some(at) = next_arrival {
                    wake = wake.min(at);
                }
                if let Some(change_ns) = load.phases.next_change_ns(ns_since(start, now)) {
                    wake = wake.min(start + Duration::from_nanos(change_ns));
                }
            }
            tokio::select! {
                biased;
                reply = rx.recv() => {
                    let mut next = Some(reply.ok_or(LabError::Io {
                        context: "reading replies",
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    })?);
                    while let Some(reply) = next {
                        let reply = reply?;
                        let Some((sent, size)) = in_flight.remove(&reply.cookie) else {
                            return Err(LabError::UnknownCookie { cookie: reply.cookie });
                        };
                        let us = u64::try_from(reply.at.saturating_duration_since(sent).as_micros())
                            .unwrap_or(MAX_LATENCY_US)
                            .min(MAX_LATENCY_US);
                        let since = reply.at.saturating_duration_since(start);
                        let s = &mut out_stats;
                        if reply.error != 0 {
                            s.errors += 1;
                        } else if reply.cookie & READ_BIT != 0 {
                            s.total_reads += 1;
                            s.total_read_bytes += u64::from(size);
                        } else {
                            s.total_writes += 1;
                            s.total_write_bytes += u64::from(size);
                        }
                        let index = usize::try_from(since.as_nanos() / bucket_ns).unwrap_or(usize::MAX);
                        if let Some(b) = s.timeline.get_mut(index) {
                            b.ios += 1;
                            b.bytes += u64::from(size);
                            b.latency_sum_us += us;
                        }
                        if since >= stats_from && since < stats_to {
                            s.ios += 1;
                            s.bytes += u64::from(size);
                            s.latency_us.saturating_record(us.max(1));
                        }
                        next = rx.try_recv().ok();
                    }
                }
                () = tokio::time::sleep_until(wake.into()) => {}
            }
        }
        out_stats.unsent = backlog;
        out.clear();
        encode_request_header(
            &mut out,
            &RequestHeader {
                flags: 0,
                command: NBD_CMD_DISC,
                cookie: seq << SEQ_SHIFT,
                offset: 0,
                length: 0,
            },
        );
        writer
            .write_all(&out)
            .await
            .map_err(LabError::io("sending NBD_CMD_DISC"))?;
        writer
            .shutdown()
            .await
            .map_err(LabError::io("closing the connection"))?;
        Ok(TenantOutcome { group: out_stats })
    }
    .await;
    reader.abort();
    result
}

/// Nanoseconds from `start` to `t` (0 before it), the time the tenants' schedules take.
fn ns_since(start: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(start).as_nanos()).unwrap_or(u64::MAX)
}
