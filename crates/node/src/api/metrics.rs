//! `GET /metrics`: OpenMetrics text (`prometheus-client`), collected at scrape time.
//!
//! Why a custom `Collector`: every number already lives in an atomic (the volume registry,
//! the scheduler's phase counters, the store's device counters); registering a second copy
//! of each counter with the library would double the work on the I/O path. The scrape reads
//! the atomics and encodes them; the I/O path never sees it.
//!
//! Cardinality: a node may have 10,000 volumes. Volumes get series of their own only if they
//! did I/O in the last `volume_series_idle_s` seconds, and at most `max_volume_series` of
//! them (the most operations since the previous scrape first, then the most recently
//! active); every other volume is summed into `volume="_other"` (so sums over `volume` stay
//! right), and `headroom_metrics_volumes_folded` says how many were. A volume moving in or
//! out of the shown set moves its counts between its own series and `_other`, so `_other`
//! is not monotonic; `rate()` over it is only meaningful while the set is stable.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use headroom_qos::{Dimension, Phase};
use headroom_store::{DeviceOp, DeviceOpStats, LATENCY_FINITE_BUCKETS, LatencySnapshot, Store};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use super::ApiState;
use crate::metrics::{MetricsRegistry, OpStats, VolumeOp, VolumeStats};
use crate::pipeline::IoJob;
use crate::scheduler::Scheduler;
use crate::sync::lock;

/// The label value of the folded volumes.
pub const OTHER_VOLUMES: &str = "_other";

const CONTENT_TYPE_OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `/metrics` route.
pub fn routes() -> Router<ApiState> {
    Router::new().route("/metrics", get(metrics))
}

/// Prometheus metrics in OpenMetrics text (docs/operations.md, "Metrics").
#[utoipa::path(get, path = "/metrics", tag = "node",
    responses(
        (status = 200, description = "OpenMetrics text", content_type = "application/openmetrics-text"),
        (status = 401, description = "No or wrong token", body = crate::api::ApiErrorBody)))]
pub(crate) async fn metrics(State(state): State<ApiState>) -> Response {
    let scrape = Scrape {
        registry: Arc::clone(&state.metrics),
        scheduler: state.scheduler.clone(),
        store: Arc::clone(&state.store),
        arbitration: lock(&state.arbitration).clone(),
        rebuild: state.rebuild.clone(),
        scrub: state.scrub.clone(),
    };
    // Reading 10,000 volumes' atomics takes milliseconds: off the runtime threads.
    let text = tokio::task::spawn_blocking(move || scrape.render()).await;
    match text {
        Ok(Ok(text)) => ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], text).into_response(),
        _ => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "encoding the metrics failed\n",
        )
            .into_response(),
    }
}

/// One scrape's sources.
#[derive(Debug)]
struct Scrape {
    registry: Arc<MetricsRegistry>,
    scheduler: Option<Arc<Scheduler<IoJob>>>,
    store: Arc<Store>,
    arbitration: crate::arbitration::ArbitrationStatus,
    rebuild: Option<Arc<crate::repair::Rebuilder>>,
    scrub: Option<Arc<crate::scrub::Scrubber>>,
}

impl Scrape {
    fn render(self) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)?;
        Ok(out)
    }
}

/// One shown series' worth of a volume (or of the folded ones).
#[derive(Clone, Debug, Default)]
struct VolumeSample {
    name: Arc<str>,
    ops: [OpStats; 7],
    queue_depth: u64,
    throttled_ns: u64,
    credits: [Option<u64>; 2],
    phase_ops: [u64; 3],
    phase_bytes: [u64; 3],
    baseline_iops: u64,
    baseline_bytes_per_s: u64,
    audit: crate::metrics::AuditView,
}

impl VolumeSample {
    fn add(&mut self, o: &VolumeSample) {
        for (a, b) in self.ops.iter_mut().zip(o.ops.iter()) {
            a.add(b);
        }
        let sum = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        sum(&mut self.queue_depth, o.queue_depth);
        sum(&mut self.throttled_ns, o.throttled_ns);
        for (a, b) in self.credits.iter_mut().zip(o.credits) {
            if let Some(b) = b {
                *a = Some(a.unwrap_or(0).saturating_add(b));
            }
        }
        for i in 0..3 {
            sum(&mut self.phase_ops[i], o.phase_ops[i]);
            sum(&mut self.phase_bytes[i], o.phase_bytes[i]);
        }
        sum(&mut self.baseline_iops, o.baseline_iops);
        sum(&mut self.baseline_bytes_per_s, o.baseline_bytes_per_s);
        sum(&mut self.audit.short_seconds, o.audit.short_seconds);
        sum(&mut self.audit.shortfall_ops, o.audit.shortfall_ops);
        sum(&mut self.audit.shortfall_bytes, o.audit.shortfall_bytes);
        sum(&mut self.audit.own_limit_seconds, o.audit.own_limit_seconds);
    }
}

/// An audit counter: name, help, and how to read it.
type AuditSeries = (
    &'static str,
    &'static str,
    fn(&crate::metrics::AuditView) -> u64,
);

/// A rate as a gauge value (0: none).
fn finite_rate(rate: u64) -> u64 {
    if rate == u64::MAX { 0 } else { rate }
}

impl Scrape {
    fn sample(&self, stats: &VolumeStats, now_ns: u64) -> VolumeSample {
        let mut sample = VolumeSample {
            name: Arc::clone(&stats.name),
            ops: stats.ops(),
            audit: stats.audit(&self.registry, now_ns),
            ..VolumeSample::default()
        };
        let handle = self.scheduler.as_ref().and_then(|s| s.handle(stats.key));
        if let (Some(scheduler), Some(handle)) = (&self.scheduler, handle) {
            let counters = handle.counters.snapshot();
            sample.queue_depth = scheduler.queued_requests(&handle) as u64;
            sample.throttled_ns = counters.throttled_ns;
            let (iops, bytes) = scheduler.credits(&handle);
            sample.credits = [iops, bytes];
            sample.phase_ops = counters.ios;
            sample.phase_bytes = counters.bytes;
            let qos = handle.qos();
            sample.baseline_iops = finite_rate(qos.baseline.iops);
            sample.baseline_bytes_per_s = finite_rate(qos.baseline.bytes_per_s);
        } else {
            let qos = stats.audited_qos();
            sample.baseline_iops = finite_rate(qos.baseline.iops);
            sample.baseline_bytes_per_s = finite_rate(qos.baseline.bytes_per_s);
        }
        sample
    }

    /// The shown volumes, then the folded sum and how many were folded.
    fn volumes(&self) -> (Vec<VolumeSample>, Option<VolumeSample>, u64) {
        let config = self.registry.config();
        let now_ns = self.registry.clock().now_ns();
        let now_s = now_ns / 1_000_000_000;
        let all = self.registry.all();
        // (ops since the previous scrape, last active second, stats)
        let mut ranked: Vec<(u64, u64, &Arc<VolumeStats>)> = all
            .iter()
            .map(|stats| {
                let ops: u64 = stats.ops().iter().map(|o| o.ops).sum();
                (stats.ops_since_scrape(ops), stats.last_active_s(), stats)
            })
            .collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut shown = Vec::new();
        let mut other: Option<VolumeSample> = None;
        let mut folded = 0u64;
        for (_, last_active_s, stats) in ranked {
            let active = last_active_s.saturating_add(config.volume_series_idle_s) >= now_s
                && stats.ops().iter().any(|o| o.ops > 0);
            let sample = self.sample(stats, now_ns);
            if active && shown.len() < config.max_volume_series {
                shown.push(sample);
            } else {
                folded += 1;
                other
                    .get_or_insert_with(|| VolumeSample {
                        name: Arc::from(OTHER_VOLUMES),
                        ..VolumeSample::default()
                    })
                    .add(&sample);
            }
        }
        shown.sort_by(|a, b| a.name.cmp(&b.name));
        (shown, other, folded)
    }
}

fn counter(encoder: MetricEncoder<'_>, value: u64) -> Result<(), std::fmt::Error> {
    ConstCounter::new(value).encode(encoder)
}

fn gauge(encoder: MetricEncoder<'_>, value: i64) -> Result<(), std::fmt::Error> {
    ConstGauge::new(value).encode(encoder)
}

fn gauge_f64(encoder: MetricEncoder<'_>, value: f64) -> Result<(), std::fmt::Error> {
    ConstGauge::new(value).encode(encoder)
}

fn gauge_u64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn histogram(mut encoder: MetricEncoder<'_>, h: &LatencySnapshot) -> Result<(), std::fmt::Error> {
    let mut buckets: Vec<(f64, u64)> = Vec::with_capacity(LATENCY_FINITE_BUCKETS + 1);
    for (i, &n) in h.buckets.iter().enumerate() {
        let bound = if i < LATENCY_FINITE_BUCKETS {
            LatencySnapshot::bound_seconds(i)
        } else {
            f64::INFINITY
        };
        buckets.push((bound, n));
    }
    encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        h.sum_ns as f64 / 1e9,
        h.count(),
        &buckets,
        None,
    )
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (shown, other, folded) = self.volumes();
        let series: Vec<&VolumeSample> = shown.iter().chain(other.iter()).collect();
        let vol = |s: &VolumeSample| [("volume", s.name.to_string())];
        let vol_op = |s: &VolumeSample, op: VolumeOp| {
            [
                ("volume", s.name.to_string()),
                ("op", op.name().to_string()),
            ]
        };
        // Operations a volume has done (a series per op it used; all ops for none would be
        // 7 histograms per volume).
        fn used(s: &VolumeSample) -> impl Iterator<Item = VolumeOp> + '_ {
            VolumeOp::ALL
                .into_iter()
                .filter(move |op| s.ops[*op as usize].ops > 0)
        }

        let mut m = encoder.encode_descriptor(
            "headroom_volume_ops",
            "Requests answered, by NBD operation",
            None,
            MetricType::Counter,
        )?;
        for s in &series {
            for op in used(s) {
                counter(m.encode_family(&vol_op(s, op))?, s.ops[op as usize].ops)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_bytes",
            "Payload bytes of answered READ and WRITE requests",
            None,
            MetricType::Counter,
        )?;
        for s in &series {
            for op in [VolumeOp::Read, VolumeOp::Write] {
                if s.ops[op as usize].ops > 0 {
                    counter(m.encode_family(&vol_op(s, op))?, s.ops[op as usize].bytes)?;
                }
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_errors",
            "Requests answered with an error",
            None,
            MetricType::Counter,
        )?;
        for s in &series {
            for op in used(s) {
                counter(m.encode_family(&vol_op(s, op))?, s.ops[op as usize].errors)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_latency",
            "Time from a request's header read to its reply handed to the writer",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for s in &series {
            for op in used(s) {
                histogram(
                    m.encode_family(&vol_op(s, op))?,
                    &s.ops[op as usize].latency,
                )?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_queue_depth",
            "Requests waiting in the scheduler",
            None,
            MetricType::Gauge,
        )?;
        for s in &series {
            gauge(m.encode_family(&vol(s))?, gauge_u64(s.queue_depth))?;
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_throttled",
            "Time requests were held back by the scheduler, summed over requests",
            Some(&Unit::Seconds),
            MetricType::Counter,
        )?;
        for s in &series {
            ConstCounter::new(s.throttled_ns as f64 / 1e9).encode(m.encode_family(&vol(s))?)?;
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_credits",
            "Burst credit balance (I/O units or bytes); absent for a bucket the volume lacks",
            None,
            MetricType::Gauge,
        )?;
        for s in &series {
            for (dim, value) in ["iops", "bytes"].into_iter().zip(s.credits) {
                if let Some(value) = value {
                    let labels = [
                        ("volume", s.name.to_string()),
                        ("dimension", dim.to_string()),
                    ];
                    gauge(m.encode_family(&labels)?, gauge_u64(value))?;
                }
            }
        }
        let phase_labels = |s: &VolumeSample, phase: Phase| {
            [
                ("volume", s.name.to_string()),
                ("phase", phase.as_str().to_string()),
            ]
        };
        let mut m = encoder.encode_descriptor(
            "headroom_volume_phase_ops",
            "Requests completed, by the scheduler phase they ran in",
            None,
            MetricType::Counter,
        )?;
        for s in &series {
            for (i, phase) in Phase::ALL.into_iter().enumerate() {
                counter(m.encode_family(&phase_labels(s, phase))?, s.phase_ops[i])?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_phase_bytes",
            "Payload bytes completed, by the scheduler phase they ran in",
            None,
            MetricType::Counter,
        )?;
        for s in &series {
            for (i, phase) in Phase::ALL.into_iter().enumerate() {
                counter(m.encode_family(&phase_labels(s, phase))?, s.phase_bytes[i])?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_baseline_iops",
            "The volume's baseline IOPS (0: none)",
            None,
            MetricType::Gauge,
        )?;
        for s in &series {
            gauge(m.encode_family(&vol(s))?, gauge_u64(s.baseline_iops))?;
        }
        let mut m = encoder.encode_descriptor(
            "headroom_volume_baseline_bytes_per_second",
            "The volume's baseline payload bytes per second (0: none)",
            None,
            MetricType::Gauge,
        )?;
        for s in &series {
            gauge(m.encode_family(&vol(s))?, gauge_u64(s.baseline_bytes_per_s))?;
        }
        let audit: [AuditSeries; 4] = [
            (
                "headroom_volume_promise_short_seconds",
                "Seconds in which the volume asked for its baseline and was served less",
                |a| a.short_seconds,
            ),
            (
                "headroom_volume_promise_shortfall_ops",
                "Requests the volume was not served in its short seconds",
                |a| a.shortfall_ops,
            ),
            (
                "headroom_volume_promise_shortfall_bytes",
                "Payload bytes the volume was not served in its short seconds",
                |a| a.shortfall_bytes,
            ),
            (
                "headroom_volume_own_limit_seconds",
                "Seconds (not short) in which the volume was held at its own ceiling or empty credits",
                |a| a.own_limit_seconds,
            ),
        ];
        for (name, help, get) in audit {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &series {
                counter(m.encode_family(&vol(s))?, get(&s.audit))?;
            }
        }
        let m = encoder.encode_descriptor(
            "headroom_metrics_volumes_folded",
            "Volumes summed into volume=\"_other\" instead of series of their own",
            None,
            MetricType::Gauge,
        )?;
        gauge(m, gauge_u64(folded))?;
        let m = encoder.encode_descriptor(
            "headroom_metadata_ready",
            "1 while the node can commit metadata and its metadata reserve is intact (GET /readyz), 0 otherwise (also once it lost its RADOS store's lease)",
            None,
            MetricType::Gauge,
        )?;
        // Without a probe commit: a scrape must not wait for a device or cluster that
        // does not answer (`/readyz` probes, within its bound).
        gauge(m, i64::from(self.store.commit_health_known().is_ready()))?;

        if let Some(rebuild) = &self.rebuild {
            let m = encoder.encode_descriptor(
                "headroom_rebuild_bytes",
                "Bytes copied by rebuilds of lost copies since the node started",
                None,
                MetricType::Counter,
            )?;
            counter(m, rebuild.bytes_total())?;
            let m = encoder.encode_descriptor(
                "headroom_rebuild_extents_remaining",
                "Lost copies (2 MiB extents) of replicated volumes still to rebuild",
                None,
                MetricType::Gauge,
            )?;
            gauge(m, gauge_u64(rebuild.extents_remaining()))?;
            let m = encoder.encode_descriptor(
                "headroom_rebuild_rate_bytes_per_second",
                "The rate the rebuild is paced at (PUT /v1/rebuild)",
                None,
                MetricType::Gauge,
            )?;
            gauge(m, gauge_u64(rebuild.rate_bytes_per_s()))?;
        }

        if let Some(scrub) = &self.scrub {
            let totals = scrub.totals();
            for (name, help, value) in [
                (
                    "headroom_scrub_blocks_verified",
                    "4 KiB blocks scrubs read below the page cache and verified against their checksums",
                    totals.blocks_verified,
                ),
                (
                    "headroom_scrub_checksum_mismatches",
                    "Blocks (of any copy) scrubs found failing their checksums",
                    totals.checksum_mismatches,
                ),
                (
                    "headroom_scrub_checksum_repaired",
                    "Blocks scrubs rewrote from a copy that verifies",
                    totals.checksum_repaired,
                ),
                (
                    "headroom_scrub_unrepairable_blocks",
                    "Blocks scrubs found with no copy that verifies (reads of them answer EIO)",
                    totals.unrepairable,
                ),
                (
                    "headroom_scrub_passes",
                    "Passes of the background scrub finished since the node started",
                    scrub.passes_done(),
                ),
            ] {
                let m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                counter(m, value)?;
            }
            let m = encoder.encode_descriptor(
                "headroom_scrub_rate_bytes_per_second",
                "The rate the background scrub reads at (PUT /v1/scrub)",
                None,
                MetricType::Gauge,
            )?;
            gauge(m, gauge_u64(scrub.rate_bytes_per_s()))?;
        }

        if let Some(scheduler) = &self.scheduler {
            let capacity = scheduler.capacity_per_second().dims();
            let dispatched = scheduler.dispatched_cost_total().dims();
            let dim = |d: Dimension| [("dimension", d.as_str())];
            let mut m = encoder.encode_descriptor(
                "headroom_node_capacity_per_second",
                "The node's capacity per second per dimension (+Inf: unlimited)",
                None,
                MetricType::Gauge,
            )?;
            for d in Dimension::ALL {
                let value = capacity[d.index()];
                let value = if value == u64::MAX {
                    f64::INFINITY
                } else {
                    value as f64
                };
                ConstGauge::new(value).encode(m.encode_family(&dim(d))?)?;
            }
            let mut m = encoder.encode_descriptor(
                "headroom_node_dispatched_cost",
                "Estimated cost of every request dispatched since start, per dimension",
                None,
                MetricType::Counter,
            )?;
            for d in Dimension::ALL {
                counter(m.encode_family(&dim(d))?, dispatched[d.index()])?;
            }
        }

        if self.arbitration.enabled {
            let a = &self.arbitration;
            for (name, help, value) in [
                (
                    "headroom_arbitration_epoch",
                    "The newest split of the shared backend this node has read",
                    a.epoch,
                ),
                (
                    "headroom_arbitration_is_arbiter",
                    "1 while this node holds the arbiter lock",
                    u64::from(a.is_arbiter),
                ),
                (
                    "headroom_arbitration_share_units_per_second",
                    "The backend capacity this node runs at (device units per second)",
                    a.share_units_per_s,
                ),
                (
                    "headroom_arbitration_demand_units_per_second",
                    "What this node reported it could use (device units per second)",
                    a.demand_units_per_s,
                ),
                (
                    "headroom_arbitration_reserved_units_per_second",
                    "What this node's baselines need, as reported (device units per second)",
                    a.reserved_units_per_s,
                ),
                (
                    "headroom_arbitration_fallback",
                    "1 while this node runs at its fallback share (no recent split)",
                    u64::from(a.fallback),
                ),
            ] {
                let m = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                gauge(m, gauge_u64(value))?;
            }
        }

        let devices = self.store.device_stats();
        let dev_op = |device: &str, op: DeviceOp| {
            [
                ("device", device.to_string()),
                ("op", op.name().to_string()),
            ]
        };
        for (name, help, value) in [
            (
                "headroom_device_ops",
                "Operations on a backing device",
                (|s: &DeviceOpStats| s.ops) as fn(&DeviceOpStats) -> u64,
            ),
            (
                "headroom_device_errors",
                "Failed operations on a backing device (ENOSPC not included)",
                |s: &DeviceOpStats| s.errors,
            ),
            (
                "headroom_device_bytes",
                "Bytes read, written or zeroed on a backing device (0 for punch and sync)",
                |s: &DeviceOpStats| s.bytes,
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for d in &devices {
                for op in DeviceOp::ALL {
                    counter(
                        m.encode_family(&dev_op(&d.device, op))?,
                        value(&d.ops[op as usize]),
                    )?;
                }
            }
        }
        for (name, help, value) in [
            (
                "headroom_device_checksum_errors",
                "4 KiB blocks of a backing device that failed checksum verification (always 0 \
                 on a device without checksums)",
                (|d: &headroom_store::DeviceStats| d.checksum_errors)
                    as fn(&headroom_store::DeviceStats) -> u64,
            ),
            (
                "headroom_device_repaired_blocks",
                "4 KiB blocks of a backing device rewritten from a good copy after they failed \
                 verification",
                |d: &headroom_store::DeviceStats| d.repaired_blocks,
            ),
        ] {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for d in &devices {
                counter(m.encode_family(&[("device", d.device.clone())])?, value(d))?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "headroom_device_latency",
            "Time an operation took on a backing device",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for d in devices.iter().filter(|d| d.timed) {
            for op in DeviceOp::ALL {
                histogram(
                    m.encode_family(&dev_op(&d.device, op))?,
                    &d.ops[op as usize].latency,
                )?;
            }
        }
        encode_device_telemetry(&self.store, &mut encoder, &devices)
    }
}

/// The devices' smoothed view (store `telemetry`), as of the sampler's last interval.
fn encode_device_telemetry(
    store: &headroom_store::Store,
    encoder: &mut DescriptorEncoder<'_>,
    devices: &[headroom_store::DeviceStats],
) -> Result<(), std::fmt::Error> {
    let telemetry = store.device_telemetry();
    let rows: Vec<(&str, &headroom_store::DeviceTelemetry)> = devices
        .iter()
        .map(|d| d.device.as_str())
        .zip(telemetry.iter())
        .collect();
    let labels = |device: &str, op: &str| [("device", device.to_string()), ("op", op.to_string())];
    type Pick = fn(&headroom_store::DeviceTelemetry) -> Option<f64>;
    let families: [(&str, &str, Option<Unit>, Pick, Pick); 3] = [
        (
            "headroom_device_telemetry_iops",
            "Operations per second on a backing device, smoothed (EWMA over the sampling intervals)",
            None,
            |t| Some(t.read_iops),
            |t| Some(t.write_iops),
        ),
        (
            "headroom_device_telemetry_bytes_per_second",
            "Bytes per second read and written on a backing device, smoothed",
            None,
            |t| Some(t.read_bytes_per_s),
            |t| Some(t.write_bytes_per_s),
        ),
        (
            "headroom_device_telemetry_latency",
            "Mean time of an operation on a backing device, smoothed (absent until timed)",
            Some(Unit::Seconds),
            |t| t.read_latency_us.map(|us| us / 1e6),
            |t| t.write_latency_us.map(|us| us / 1e6),
        ),
    ];
    for (name, help, unit, read, write) in families {
        let mut m = encoder.encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
        for (device, t) in &rows {
            for (op, pick) in [("read", read), ("write", write)] {
                if let Some(value) = pick(t) {
                    gauge_f64(m.encode_family(&labels(device, op))?, value)?;
                }
            }
        }
    }
    let mut m = encoder.encode_descriptor(
            "headroom_device_telemetry_write_cost",
            "Time per KiB written over time per KiB read on a backing device (absent until both were timed)",
            None,
            MetricType::Gauge,
        )?;
    for (device, t) in &rows {
        if let Some(cost) = t.write_cost {
            gauge_f64(m.encode_family(&[("device", device.to_string())])?, cost)?;
        }
    }
    Ok(())
}
