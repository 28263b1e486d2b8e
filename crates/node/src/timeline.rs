//! The node's recent history, second by second: what `GET /v1/stats`, the dashboard at `/`
//! and `headroom top` show.
//!
//! The hot path already keeps cumulative counters (the scheduler's dispatched cost per
//! dimension, and per volume the I/Os, bytes and latency per phase, all relaxed atomics). A
//! sampler task reads them once per interval and turns the differences into rates, so the
//! views cost the I/O path nothing: no per-request work is added here.
//!
//! Memory is bounded whatever the node holds: [`HISTORY_SAMPLES`] samples (10 minutes at the
//! default 1 s), each with at most [`HISTORY_VOLUMES`] volumes (the busiest of the interval,
//! then idle ones in name order while there is room), and one "latest" row per volume for at
//! most [`MAX_VOLUMES`] volumes (in the store's name order; `volumes_total` says how many
//! there were). Worst case about 600 × 64 + 10,000 rows of ~200 bytes: under 10 MB.
//!
//! Per volume, rates, mean and p99 latency and the promise audit come from the node's
//! per-operation stats (`node::metrics`), which run whatever the policy; the scheduler adds
//! the per-phase split, credits and queue depth. Without a scheduler (`policy = "off"`)
//! those three and the node's utilisation are `null` and the report says why. The p99 is the
//! upper bound of the latency histogram's bucket that holds it (buckets double in width).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use headroom_qos::{CostVector, IoRate};
use headroom_store::Store;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::metrics::{MetricsRegistry, OpStats};
use crate::pipeline::IoJob;
use crate::scheduler::{PhaseStats, Scheduler};
use crate::sync::lock;
use crate::volume_qos::{CreditsView, RateView, effective_qos};

/// How often the sampler runs by default.
pub const DEFAULT_SAMPLE_INTERVAL_MS: u64 = 1_000;
/// Samples kept (the oldest is dropped first).
pub const HISTORY_SAMPLES: usize = 600;
/// Volumes kept per sample in the history.
pub const HISTORY_VOLUMES: usize = 64;
/// Volumes followed at all (the store may hold more: they are left out and counted).
pub const MAX_VOLUMES: usize = 10_000;

/// A value per capacity dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dimensions<T> {
    pub cpu_ns: T,
    pub ingress_bytes: T,
    pub egress_bytes: T,
    pub device_units: T,
}

impl<T> Dimensions<T> {
    fn from_fn(mut f: impl FnMut(fn(&CostVector) -> u64) -> T) -> Dimensions<T> {
        Dimensions {
            cpu_ns: f(|c| c.cpu_ns),
            ingress_bytes: f(|c| c.ingress_bytes),
            egress_bytes: f(|c| c.egress_bytes),
            device_units: f(|c| c.device_units),
        }
    }
}

/// The node in one interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeSample {
    /// Dispatched cost over capacity × interval per dimension (0.5 = 50 %); `null`: the
    /// dimension is unlimited, or no scheduler runs. Can exceed 1 briefly (the cost model's
    /// estimates, charged at dispatch).
    pub utilisation: Dimensions<Option<f64>>,
    /// I/Os per second completed by the followed volumes (`null`: no volume had counters).
    pub iops: Option<f64>,
    /// Payload bytes per second completed by the followed volumes.
    pub bytes_per_s: Option<f64>,
}

/// I/Os per second by the phase they ran in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseIops {
    pub baseline: f64,
    pub burst_credit: f64,
    pub burst_spare: f64,
}

/// The part of its baseline a volume left unused in the interval: capacity it lends to
/// volumes bursting on spare capacity. `null` field: no finite baseline in that dimension.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lending {
    pub unused_iops: Option<f64>,
    pub unused_bytes_per_s: Option<f64>,
}

/// The promise audit's view of a volume in the interval (differences of `node::metrics`'
/// audit totals).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromiseAudit {
    /// Time the volume wanted its baseline and got less.
    pub short_seconds: f64,
    pub shortfall_ops: u64,
    pub shortfall_bytes: u64,
}

/// One volume in one interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeSample {
    pub name: String,
    pub tenant: Option<String>,
    /// Completed I/Os per second, every operation (`null`: no counters for it yet).
    pub iops: Option<f64>,
    /// Completed payload bytes per second.
    pub bytes_per_s: Option<f64>,
    /// Mean time from arrival to completion of the interval's I/Os, µs (`null`: none
    /// completed, or no counters).
    pub latency_us_mean: Option<f64>,
    /// 99th percentile latency, µs, when per-op stats provide it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us_p99: Option<f64>,
    /// Requests waiting in the scheduler at the end of the interval.
    pub queue_depth: Option<usize>,
    /// Credit balances (whole credits; a `null` bucket: the class has none).
    pub credits: Option<CreditsView>,
    pub phase_iops: Option<PhaseIops>,
    /// Some of the interval's I/Os ran in a burst phase (on credits or on spare capacity).
    pub bursting: bool,
    /// The volume's baseline (`null` fields: unlimited).
    pub baseline: RateView,
    /// Unused baseline, when it used less than its baseline (`null`: it did not, or has no
    /// finite baseline, or there are no counters).
    pub lending: Option<Lending>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promise: Option<PromiseAudit>,
}

impl Default for VolumeSample {
    fn default() -> Self {
        VolumeSample {
            name: String::new(),
            tenant: None,
            iops: None,
            bytes_per_s: None,
            latency_us_mean: None,
            latency_us_p99: None,
            queue_depth: None,
            credits: None,
            phase_iops: None,
            bursting: false,
            baseline: RateView {
                iops: None,
                bytes_per_s: None,
            },
            lending: None,
            promise: None,
        }
    }
}

impl VolumeSample {
    fn activity(&self) -> (f64, f64) {
        (self.iops.unwrap_or(0.0), self.bytes_per_s.unwrap_or(0.0))
    }

    fn is_active(&self) -> bool {
        let (iops, bytes) = self.activity();
        iops > 0.0 || bytes > 0.0 || self.queue_depth.unwrap_or(0) > 0
    }
}

/// One interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Wall-clock end of the interval.
    pub unix_ms: u64,
    /// Its measured length.
    pub interval_ms: u64,
    pub node: NodeSample,
    /// Volumes active in the interval, busiest (IOPS) first, then idle ones while there is
    /// room; at most [`HISTORY_VOLUMES`].
    pub volumes: Vec<VolumeSample>,
    /// Volumes with I/O or queued requests in the interval (may exceed `volumes.len()`).
    pub volumes_active: usize,
}

/// A volume bursting in the latest interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BurstingView {
    pub name: String,
    pub burst_credit_iops: f64,
    pub burst_spare_iops: f64,
}

/// A volume lending unused baseline in the latest interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LendingView {
    pub name: String,
    #[serde(flatten)]
    pub lending: Lending,
}

/// Totals of the lenders in the latest interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpareSummary {
    pub lending_volumes: usize,
    pub unused_baseline_iops: f64,
    pub unused_baseline_bytes_per_s: f64,
}

/// Body of `GET /v1/stats`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatsReport {
    /// The scheduler's policy (`off`: none runs).
    pub policy: String,
    /// Whether a scheduler runs (its counters are where per-volume numbers come from).
    pub scheduler: bool,
    /// Why numbers are missing, when they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The sampler's interval.
    pub interval_ms: u64,
    /// The node's capacity per second per dimension (`null`: unlimited or no scheduler).
    pub capacity_per_second: Dimensions<Option<u64>>,
    /// Volumes in the store, and how many of them are followed (at most 10,000).
    pub volumes_total: usize,
    pub volumes_tracked: usize,
    /// The samples of the last `seconds`, oldest first.
    pub samples: Vec<Sample>,
    /// Every followed volume in the latest interval, busiest first (at most `limit`).
    pub volumes: Vec<VolumeSample>,
    /// Volumes bursting in the latest interval, most burst IOPS first (at most `limit`).
    pub bursting: Vec<BurstingView>,
    /// Volumes using less than their baseline, most unused IOPS first (at most `limit`).
    pub lending: Vec<LendingView>,
    pub spare: SpareSummary,
}

/// Where the counters are.
#[derive(Clone, Debug)]
pub struct Sources {
    pub store: Arc<Store>,
    pub scheduler: Option<Arc<Scheduler<IoJob>>>,
    /// Per-operation stats and the promise audit (`None`: rates come from the scheduler).
    pub metrics: Option<Arc<MetricsRegistry>>,
}

/// A volume's per-operation totals and audit at one sample.
#[derive(Clone, Copy, Debug)]
struct OpTotals {
    all: OpStats,
    short_seconds: u64,
    shortfall_ops: u64,
    shortfall_bytes: u64,
}

struct Previous {
    at: Instant,
    cost: Option<CostVector>,
    /// Phase counters per volume id (followed volumes only).
    volumes: HashMap<u64, PhaseStats>,
    /// Per-operation totals per volume id (followed volumes only).
    ops: HashMap<u64, OpTotals>,
}

#[derive(Default)]
struct History {
    samples: VecDeque<Sample>,
    /// The latest interval's rows of every followed volume, in the store's order.
    latest: Vec<VolumeSample>,
    volumes_total: usize,
    previous: Option<Previous>,
}

/// The ring buffer and what fills it.
pub struct Timeline {
    sources: Sources,
    interval_ms: u64,
    history: Mutex<History>,
    /// Origin of the times given to the store's device telemetry.
    origin: Instant,
}

impl std::fmt::Debug for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeline")
            .field("interval_ms", &self.interval_ms)
            .finish_non_exhaustive()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Rounds for JSON (rates to 0.1, so a page and a test see the same numbers).
fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// Utilisation of one dimension: `delta` cost over `capacity_per_s` × `interval_s`.
pub fn utilisation(delta: u64, capacity_per_s: u64, interval_s: f64) -> Option<f64> {
    if capacity_per_s == u64::MAX || capacity_per_s == 0 || interval_s <= 0.0 {
        return None;
    }
    Some((delta as f64 / (capacity_per_s as f64 * interval_s) * 1000.0).round() / 1000.0)
}

/// Rates of a volume from two snapshots of its phase counters `interval_s` apart:
/// (IOPS, bytes/s, mean latency µs, IOPS per phase, bursting).
pub fn volume_rates(
    before: &PhaseStats,
    now: &PhaseStats,
    interval_s: f64,
) -> (f64, f64, Option<f64>, PhaseIops, bool) {
    let delta = |a: &[u64; 3], b: &[u64; 3], i: usize| b[i].saturating_sub(a[i]);
    let ios: [u64; 3] = std::array::from_fn(|i| delta(&before.ios, &now.ios, i));
    let bytes: u64 = (0..3).map(|i| delta(&before.bytes, &now.bytes, i)).sum();
    let latency_ns: u64 = (0..3)
        .map(|i| delta(&before.latency_ns, &now.latency_ns, i))
        .sum();
    let total: u64 = ios.iter().sum();
    let per_s = |v: u64| {
        if interval_s > 0.0 {
            round1(v as f64 / interval_s)
        } else {
            0.0
        }
    };
    let latency_us = (total > 0).then(|| round1(latency_ns as f64 / total as f64 / 1000.0));
    let phases = PhaseIops {
        baseline: per_s(ios[0]),
        burst_credit: per_s(ios[1]),
        burst_spare: per_s(ios[2]),
    };
    (
        per_s(total),
        per_s(bytes),
        latency_us,
        phases,
        ios[1] + ios[2] > 0,
    )
}

/// The upper bound, in µs, of the histogram bucket holding the 99th percentile of the
/// observations `after` has beyond `before` (`None`: none).
pub fn latency_us_p99(
    before: &headroom_store::LatencySnapshot,
    after: &headroom_store::LatencySnapshot,
) -> Option<f64> {
    let deltas: Vec<u64> = after
        .buckets
        .iter()
        .zip(before.buckets.iter())
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let count: u64 = deltas.iter().sum();
    if count == 0 {
        return None;
    }
    // The smallest rank with at least 99 % of the observations at or below it.
    let rank = count - count / 100;
    let mut seen = 0;
    for (i, n) in deltas.iter().enumerate() {
        seen += n;
        if seen >= rank {
            if i + 1 == deltas.len() {
                // The overflow bucket has no upper bound: report its lower one.
                return Some(headroom_store::LatencySnapshot::bound_seconds(i - 1) * 1e6);
            }
            return Some(headroom_store::LatencySnapshot::bound_seconds(i) * 1e6);
        }
    }
    None
}

/// What a volume left unused of its baseline at `iops` and `bytes_per_s`.
pub fn lending(baseline: IoRate, iops: f64, bytes_per_s: f64) -> Option<Lending> {
    let unused =
        |limit: u64, used: f64| (limit != u64::MAX).then(|| round1((limit as f64 - used).max(0.0)));
    let lending = Lending {
        unused_iops: unused(baseline.iops, iops),
        unused_bytes_per_s: unused(baseline.bytes_per_s, bytes_per_s),
    };
    let lends = |v: Option<f64>| v.is_some_and(|v| v > 0.0);
    (lends(lending.unused_iops) || lends(lending.unused_bytes_per_s)).then_some(lending)
}

/// Busiest first: IOPS, then bytes/s, then name.
fn by_activity(a: &VolumeSample, b: &VolumeSample) -> std::cmp::Ordering {
    let (ai, ab) = a.activity();
    let (bi, bb) = b.activity();
    bi.total_cmp(&ai)
        .then(bb.total_cmp(&ab))
        .then_with(|| a.name.cmp(&b.name))
}

/// The history's rows of one interval: active volumes busiest first, then idle ones in
/// their order, at most `cap`.
fn history_rows(latest: &[VolumeSample], cap: usize) -> (Vec<VolumeSample>, usize) {
    let mut active: Vec<&VolumeSample> = latest.iter().filter(|v| v.is_active()).collect();
    let active_count = active.len();
    active.sort_by(|a, b| by_activity(a, b));
    let mut rows: Vec<VolumeSample> = active.into_iter().take(cap).cloned().collect();
    if rows.len() < cap {
        let room = cap - rows.len();
        rows.extend(latest.iter().filter(|v| !v.is_active()).take(room).cloned());
    }
    (rows, active_count)
}

impl Timeline {
    pub fn new(sources: Sources, interval_ms: u64) -> Arc<Timeline> {
        Arc::new(Timeline {
            sources,
            interval_ms: interval_ms.max(1),
            history: Mutex::new(History::default()),
            origin: Instant::now(),
        })
    }

    pub fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Samples every interval until `stop` turns true (or its sender goes away).
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut ticker = tokio::time::interval(Duration::from_millis(self.interval_ms));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    // Off the network threads: with thousands of volumes a sample takes
                    // milliseconds (a short lock per volume and worker for credits and queue).
                    let timeline = Arc::clone(&self);
                    let _ = tokio::task::spawn_blocking(move || timeline.sample()).await;
                }
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
        }
    }

    /// Reads the counters and, from the second call on, appends a sample.
    pub fn sample(&self) {
        self.sample_at(Instant::now());
    }

    /// [`Timeline::sample`] as if the time were `now` (tests choose the interval).
    fn sample_at(&self, now: Instant) {
        // The devices' smoothed view (placement and `GET /v1/devices` read it) moves on with
        // the same interval as the history.
        let since_origin_ns = now.saturating_duration_since(self.origin).as_nanos();
        self.sources
            .store
            .observe_devices(u64::try_from(since_origin_ns).unwrap_or(u64::MAX));
        let scheduler = self.sources.scheduler.as_ref();
        let cost = scheduler.map(|s| s.dispatched_cost_total());
        let infos = self.sources.store.list_volumes();
        let volumes_total = infos.len();
        let mut counters: HashMap<u64, PhaseStats> = HashMap::new();
        let mut op_totals: HashMap<u64, OpTotals> = HashMap::new();
        let metrics = self.sources.metrics.as_ref();
        let clock_ns = metrics.map(|m| m.clock().now_ns());
        // Only the sampler writes; readers wait for the history lock only while a sample is
        // appended, not while the counters are read.
        let previous = lock(&self.history).previous.take();
        let interval_s = previous
            .as_ref()
            .map_or(0.0, |p| now.duration_since(p.at).as_secs_f64());
        let mut latest = Vec::with_capacity(infos.len().min(MAX_VOLUMES));
        for info in infos.iter().take(MAX_VOLUMES) {
            let handle = scheduler.and_then(|s| s.handle(info.id).map(|h| (s, h)));
            // The scheduler's copy is parsed already; without one, parse the stored class.
            let baseline = match &handle {
                Some((_, handle)) => handle.qos().baseline,
                None => effective_qos(info.qos.as_deref(), info.size_bytes).baseline,
            };
            let mut row = VolumeSample {
                name: info.name.clone(),
                tenant: info.tenant.clone(),
                baseline: baseline.into(),
                ..VolumeSample::default()
            };
            if let Some((scheduler, handle)) = handle {
                let stats = handle.counters.snapshot();
                let before = previous
                    .as_ref()
                    .and_then(|p| p.volumes.get(&info.id))
                    .copied()
                    // First seen: no interval to measure yet, report zero.
                    .unwrap_or(stats);
                let (iops, bytes_per_s, latency, phases, bursting) =
                    volume_rates(&before, &stats, interval_s);
                let (credits_iops, credits_bytes) = scheduler.credits(&handle);
                row.iops = Some(iops);
                row.bytes_per_s = Some(bytes_per_s);
                row.latency_us_mean = latency;
                row.phase_iops = Some(phases);
                row.bursting = bursting;
                row.queue_depth = Some(scheduler.queued_requests(&handle));
                row.credits = Some(CreditsView {
                    iops: credits_iops,
                    bytes: credits_bytes,
                });
                row.lending = lending(baseline, iops, bytes_per_s);
                counters.insert(info.id, stats);
            }
            if let (Some(metrics), Some(clock_ns)) = (metrics, clock_ns)
                && let Some(stats) = metrics.get(info.id)
            {
                let mut all = OpStats::default();
                for op in stats.ops() {
                    all.add(&op);
                }
                let audit = stats.audit(metrics, clock_ns);
                let now_totals = OpTotals {
                    all,
                    short_seconds: audit.short_seconds,
                    shortfall_ops: audit.shortfall_ops,
                    shortfall_bytes: audit.shortfall_bytes,
                };
                let before = previous
                    .as_ref()
                    .and_then(|p| p.ops.get(&info.id))
                    .copied()
                    .unwrap_or(now_totals);
                let ops = now_totals.all.ops.saturating_sub(before.all.ops);
                let bytes = now_totals.all.bytes.saturating_sub(before.all.bytes);
                let latency_ns = now_totals
                    .all
                    .latency
                    .sum_ns
                    .saturating_sub(before.all.latency.sum_ns);
                if interval_s > 0.0 {
                    // Every operation, scheduled or not (the scheduler's phase counters
                    // see only what it scheduled).
                    let iops = round1(ops as f64 / interval_s);
                    let bytes_per_s = round1(bytes as f64 / interval_s);
                    row.iops = Some(iops);
                    row.bytes_per_s = Some(bytes_per_s);
                    row.lending = lending(baseline, iops, bytes_per_s);
                }
                row.latency_us_mean =
                    (ops > 0).then(|| round1(latency_ns as f64 / ops as f64 / 1000.0));
                row.latency_us_p99 =
                    latency_us_p99(&before.all.latency, &now_totals.all.latency).map(round1);
                row.promise = Some(PromiseAudit {
                    short_seconds: now_totals
                        .short_seconds
                        .saturating_sub(before.short_seconds)
                        as f64,
                    shortfall_ops: now_totals
                        .shortfall_ops
                        .saturating_sub(before.shortfall_ops),
                    shortfall_bytes: now_totals
                        .shortfall_bytes
                        .saturating_sub(before.shortfall_bytes),
                });
                op_totals.insert(info.id, now_totals);
            }
            latest.push(row);
        }
        let mut history = lock(&self.history);
        if let Some(previous) = &previous {
            let elapsed_ms =
                u64::try_from(now.duration_since(previous.at).as_millis()).unwrap_or(u64::MAX);
            let utilisation_now = match (scheduler, cost, previous.cost) {
                (Some(scheduler), Some(cost), Some(before)) => {
                    let capacity = scheduler.capacity_per_second();
                    Dimensions::from_fn(|get| {
                        utilisation(
                            get(&cost).saturating_sub(get(&before)),
                            get(&capacity),
                            interval_s,
                        )
                    })
                }
                _ => Dimensions::default(),
            };
            let measured = latest.iter().any(|v| v.iops.is_some());
            let node = NodeSample {
                utilisation: utilisation_now,
                iops: measured.then(|| round1(latest.iter().filter_map(|v| v.iops).sum())),
                bytes_per_s: measured
                    .then(|| round1(latest.iter().filter_map(|v| v.bytes_per_s).sum())),
            };
            let (volumes, volumes_active) = history_rows(&latest, HISTORY_VOLUMES);
            if history.samples.len() >= HISTORY_SAMPLES {
                history.samples.pop_front();
            }
            history.samples.push_back(Sample {
                unix_ms: unix_ms(),
                interval_ms: elapsed_ms,
                node,
                volumes,
                volumes_active,
            });
            history.latest = latest;
        }
        history.volumes_total = volumes_total;
        history.previous = Some(Previous {
            at: now,
            cost,
            volumes: counters,
            ops: op_totals,
        });
    }

    /// The report of the last `seconds` (at most [`HISTORY_SAMPLES`] samples), with at most
    /// `limit` rows in each latest-interval list.
    pub fn report(&self, seconds: u64, limit: usize) -> StatsReport {
        let scheduler = self.sources.scheduler.as_ref();
        let capacity = scheduler.map(|s| s.capacity_per_second());
        let history = lock(&self.history);
        // The newest samples covering `seconds` at the sampler's interval.
        let wanted = usize::try_from(seconds.saturating_mul(1000).div_ceil(self.interval_ms))
            .unwrap_or(usize::MAX)
            .min(history.samples.len());
        let samples: Vec<Sample> = history
            .samples
            .iter()
            .skip(history.samples.len() - wanted)
            .cloned()
            .collect();
        let mut volumes: Vec<&VolumeSample> = history.latest.iter().collect();
        volumes.sort_by(|a, b| by_activity(a, b));
        let mut bursting: Vec<BurstingView> = history
            .latest
            .iter()
            .filter(|v| v.bursting)
            .map(|v| {
                let phases = v.phase_iops.unwrap_or_default();
                BurstingView {
                    name: v.name.clone(),
                    burst_credit_iops: phases.burst_credit,
                    burst_spare_iops: phases.burst_spare,
                }
            })
            .collect();
        bursting.sort_by(|a, b| {
            (b.burst_credit_iops + b.burst_spare_iops)
                .total_cmp(&(a.burst_credit_iops + a.burst_spare_iops))
        });
        bursting.truncate(limit);
        let mut lending: Vec<LendingView> = history
            .latest
            .iter()
            .filter_map(|v| {
                v.lending.map(|lending| LendingView {
                    name: v.name.clone(),
                    lending,
                })
            })
            .collect();
        let spare = SpareSummary {
            lending_volumes: lending.len(),
            unused_baseline_iops: round1(
                lending.iter().filter_map(|l| l.lending.unused_iops).sum(),
            ),
            unused_baseline_bytes_per_s: round1(
                lending
                    .iter()
                    .filter_map(|l| l.lending.unused_bytes_per_s)
                    .sum(),
            ),
        };
        lending.sort_by(|a, b| {
            let key = |l: &LendingView| l.lending.unused_iops.unwrap_or(0.0);
            key(b).total_cmp(&key(a)).then_with(|| a.name.cmp(&b.name))
        });
        lending.truncate(limit);
        StatsReport {
            policy: scheduler.map_or("off", |s| s.policy_name()).to_string(),
            scheduler: scheduler.is_some(),
            note: scheduler.is_none().then(|| {
                if self.sources.metrics.is_some() {
                    "policy off: no scheduler runs, so phases, credits, queue depth and the \
                     node's utilisation are null (rates and latency come from per-op stats)"
                        .to_string()
                } else {
                    "policy off: no scheduler runs, so there are no per-volume counters \
                     (rates, latency, credits and queue depth are null)"
                        .to_string()
                }
            }),
            interval_ms: self.interval_ms,
            capacity_per_second: Dimensions::from_fn(|get| {
                capacity.map(|c| get(&c)).filter(|v| *v != u64::MAX)
            }),
            volumes_total: history.volumes_total,
            volumes_tracked: history.latest.len(),
            samples,
            volumes: volumes.into_iter().take(limit).cloned().collect(),
            bursting,
            lending,
            spare,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(ios: [u64; 3], bytes: [u64; 3], latency_ns: [u64; 3]) -> PhaseStats {
        PhaseStats {
            ios,
            bytes,
            latency_ns,
            throttled_ios: 0,
            throttled_ns: 0,
        }
    }

    #[test]
    fn rates_come_from_counter_differences() {
        let before = stats([100, 0, 0], [409_600, 0, 0], [1_000_000, 0, 0]);
        let now = stats(
            [1_100, 300, 100],
            [4_505_600, 1_228_800, 409_600],
            [11_000_000, 9_000_000, 5_000_000],
        );
        let (iops, bytes, latency, phases, bursting) = volume_rates(&before, &now, 2.0);
        assert_eq!(iops, 700.0);
        assert_eq!(bytes, (4_096_000.0 + 1_228_800.0 + 409_600.0) / 2.0);
        // 24 ms over 1,400 I/Os.
        assert_eq!(latency, Some(round1(24_000_000.0 / 1_400.0 / 1_000.0)));
        assert_eq!(phases.baseline, 500.0);
        assert_eq!(phases.burst_credit, 150.0);
        assert_eq!(phases.burst_spare, 50.0);
        assert!(bursting);
        let (iops, _, latency, _, bursting) = volume_rates(&now, &now, 1.0);
        assert_eq!(iops, 0.0);
        assert_eq!(latency, None);
        assert!(!bursting);
    }

    #[test]
    fn unlimited_dimensions_have_no_utilisation() {
        assert_eq!(utilisation(500, 1_000, 1.0), Some(0.5));
        assert_eq!(utilisation(500, 1_000, 2.0), Some(0.25));
        assert_eq!(utilisation(500, u64::MAX, 1.0), None);
        assert_eq!(utilisation(500, 0, 1.0), None);
    }

    #[test]
    fn lenders_are_volumes_under_a_finite_baseline() {
        let baseline = IoRate::new(1_000, 10_000_000);
        let lent = lending(baseline, 400.0, 1_000_000.0).expect("lends");
        assert_eq!(lent.unused_iops, Some(600.0));
        assert_eq!(lent.unused_bytes_per_s, Some(9_000_000.0));
        assert_eq!(lending(baseline, 1_200.0, 20_000_000.0), None);
        assert_eq!(lending(IoRate::new(u64::MAX, u64::MAX), 0.0, 0.0), None);
        let iops_only = lending(IoRate::new(100, u64::MAX), 0.0, 0.0).expect("lends");
        assert_eq!(iops_only.unused_bytes_per_s, None);
    }

    #[test]
    fn history_rows_are_capped_busiest_first_then_idle() {
        let row = |name: &str, iops: f64| VolumeSample {
            name: name.to_string(),
            iops: Some(iops),
            ..VolumeSample::default()
        };
        let latest = vec![row("a", 0.0), row("b", 5.0), row("c", 50.0), row("d", 0.0)];
        let (rows, active) = history_rows(&latest, 3);
        assert_eq!(active, 2);
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["c", "b", "a"]);
        let (rows, active) = history_rows(&latest, 1);
        assert_eq!((rows.len(), active), (1, 2));
        assert_eq!(rows[0].name, "c");
    }

    struct Nop;
    impl crate::scheduler::Runner<IoJob> for Nop {
        fn run(&self, _: &Arc<Scheduler<IoJob>>, _: Vec<crate::scheduler::Ready<IoJob>>) {}
    }

    fn scheduler() -> Arc<Scheduler<IoJob>> {
        Scheduler::start(
            &crate::scheduler::config::QosConfig::default(),
            crate::clock::Clock::new(),
            Arc::new(Nop),
            None,
        )
        .expect("scheduler")
    }

    /// Adds completed I/Os to a volume's counters as the session would.
    fn complete(handle: &crate::scheduler::VolumeHandle, phase: usize, ios: u64, latency_ns: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        handle.counters.ios[phase].fetch_add(ios, Relaxed);
        handle.counters.bytes[phase].fetch_add(ios * 4096, Relaxed);
        handle.counters.latency_ns[phase].fetch_add(ios * latency_ns, Relaxed);
    }

    #[test]
    fn samples_show_who_bursts_and_who_lends() {
        let store = Arc::new(Store::open_memory(1 << 30).expect("memory store"));
        let scheduler = scheduler();
        let qos = |baseline_iops| headroom_qos::VolumeQos {
            baseline: IoRate::new(baseline_iops, u64::MAX),
            ..headroom_qos::VolumeQos::default()
        };
        let mut handles = Vec::new();
        for (name, baseline) in [("bursty", 100), ("lender", 1_000), ("plain", 0)] {
            let info = store.create_volume(name, 1 << 20).expect("volume");
            handles.push(scheduler.add_volume(info.id, &qos(baseline)));
        }
        let timeline = Timeline::new(
            Sources {
                store,
                scheduler: Some(scheduler),
                metrics: None,
            },
            1_000,
        );
        let start = Instant::now();
        timeline.sample_at(start);
        complete(&handles[0], 0, 100, 50_000);
        complete(&handles[0], 2, 400, 150_000);
        complete(&handles[1], 0, 200, 20_000);
        timeline.sample_at(start + Duration::from_secs(2));
        let report = timeline.report(60, 10);
        assert!(report.scheduler && report.note.is_none());
        assert_eq!(report.samples.len(), 1);
        let sample = &report.samples[0];
        assert_eq!(sample.volumes_active, 2);
        assert_eq!(sample.interval_ms, 2_000);
        let row = |name: &str| {
            report
                .volumes
                .iter()
                .find(|v| v.name == name)
                .expect("row")
                .clone()
        };
        let bursty = row("bursty");
        assert!(bursty.bursting);
        assert_eq!(bursty.iops, Some(250.0));
        assert_eq!(bursty.bytes_per_s, Some(250.0 * 4096.0));
        let phases = bursty.phase_iops.expect("phases");
        assert_eq!((phases.baseline, phases.burst_spare), (50.0, 200.0));
        // (100 × 50 µs + 400 × 150 µs) / 500.
        assert_eq!(bursty.latency_us_mean, Some(130.0));
        assert_eq!(bursty.lending, None);
        let lender = row("lender");
        assert!(!lender.bursting);
        assert_eq!(lender.iops, Some(100.0));
        assert_eq!(
            lender.lending.and_then(|l| l.unused_iops),
            Some(900.0),
            "1,000 IOPS baseline, 100 used"
        );
        assert_eq!(report.spare.unused_baseline_iops, 900.0);
        assert_eq!(report.bursting.len(), 1);
        assert_eq!(report.bursting[0].name, "bursty");
        // A zero baseline lends nothing: "plain" is no lender.
        let lenders: Vec<&str> = report.lending.iter().map(|l| l.name.as_str()).collect();
        assert!(lenders.contains(&"lender") && !lenders.contains(&"plain"));
        assert_eq!(report.volumes[0].name, "bursty", "busiest first");
        assert!(sample.node.utilisation.ingress_bytes.is_none(), "unlimited");
    }

    #[test]
    fn memory_is_bounded_at_ten_thousand_volumes() {
        let store = Arc::new(Store::open_memory(64 << 30).expect("memory store"));
        let scheduler = scheduler();
        for i in 0..MAX_VOLUMES + 3 {
            let info = store
                .create_volume(&format!("v{i:05}"), 1 << 20)
                .expect("volume");
            scheduler.add_volume(info.id, &headroom_qos::VolumeQos::default());
        }
        let timeline = Timeline::new(
            Sources {
                store,
                scheduler: Some(scheduler),
                metrics: None,
            },
            1_000,
        );
        timeline.sample();
        let started = Instant::now();
        timeline.sample();
        let took = started.elapsed();
        eprintln!("one sample of {} volumes took {took:?}", MAX_VOLUMES + 3);
        let report = timeline.report(60, MAX_VOLUMES);
        assert_eq!(report.volumes_total, MAX_VOLUMES + 3);
        assert_eq!(report.volumes_tracked, MAX_VOLUMES);
        assert_eq!(report.samples[0].volumes.len(), HISTORY_VOLUMES);
        assert_eq!(timeline.report(60, 7).volumes.len(), 7);
    }

    #[test]
    fn p99_is_the_bound_of_the_bucket_holding_it_in_the_interval() {
        let empty = headroom_store::LatencySnapshot::default();
        let mut before = empty;
        // Earlier observations are not the interval's: they must not count.
        before.buckets[headroom_store::latency_bucket(5_000_000)] = 1_000;
        let mut after = before;
        after.buckets[headroom_store::latency_bucket(20_000)] += 98;
        after.buckets[headroom_store::latency_bucket(900_000)] += 2;
        let bound = |ns: u64| {
            headroom_store::LatencySnapshot::bound_seconds(headroom_store::latency_bucket(ns)) * 1e6
        };
        // 100 observations: the 99th is in the 900 µs bucket.
        assert_eq!(latency_us_p99(&before, &after), Some(bound(900_000)));
        after.buckets[headroom_store::latency_bucket(20_000)] += 100;
        // 200: the 198th is still among the fast ones.
        assert_eq!(latency_us_p99(&before, &after), Some(bound(20_000)));
        assert_eq!(latency_us_p99(&after, &after), None);
    }

    #[test]
    fn the_ring_buffer_keeps_the_newest_samples() {
        let store = Arc::new(Store::open_memory(1 << 30).expect("memory store"));
        store.create_volume("v", 1 << 20).expect("volume");
        let timeline = Timeline::new(
            Sources {
                store,
                scheduler: None,
                metrics: None,
            },
            1_000,
        );
        for _ in 0..HISTORY_SAMPLES + 5 {
            timeline.sample();
        }
        let report = timeline.report(u64::MAX / 1000, 10);
        // The first call only records counters.
        assert_eq!(lock(&timeline.history).samples.len(), HISTORY_SAMPLES);
        assert!(report.samples.len() <= HISTORY_SAMPLES);
        assert!(!report.scheduler);
        assert!(report.note.is_some());
        assert_eq!(report.volumes.len(), 1);
        assert_eq!(report.volumes[0].iops, None);
        assert_eq!(report.volumes_total, 1);
        assert_eq!(report.samples.len(), HISTORY_SAMPLES);
        assert_eq!(timeline.report(1, 10).samples.len(), 1);
        assert_eq!(timeline.report(5, 10).samples.len(), 5);
    }
}
