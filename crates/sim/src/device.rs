//! Backend device service-time model.
//!
//! A device is a pipeline with two parts:
//! - a FIFO *throughput server*: each I/O holds it for its IOCost device time `c` (how much of
//!   the device's throughput the I/O uses), so a busy device completes `1/c` I/Os per second;
//! - an *access latency* `L` that overlapping I/Os hide from each other, up to `parallelism`
//!   I/Os in flight (0 = unbounded): the internal parallelism of an SSD, or `1` for a disk that
//!   serves one request at a time.
//!
//! A lone I/O therefore takes `c + L`; a saturated device queues at the server. Costs come
//! from the Linux blk-iocost linear model (docs/background.md §6): per direction, a base cost for a
//! sequential or random I/O plus a per-4-KiB-page cost, derived from the six numbers of an
//! `io.cost.model` line (the four built-in kernel profiles are available by name). A measured
//! table (achieved IOPS per size, as Libra plots them, §4.2) can be used instead when the curve
//! is not affine in size. Sequential vs random is decided on the *device's* head position, so
//! interleaved sequential streams from different tenants really do become random — the
//! interference FAST measured (§3). Reads are slowed by concurrent writes through a linear
//! interference factor.

use crate::error::SimError;
use headroom_qos::OpKind;
use headroom_qos::routing::StreamTracker;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Bytes per page in the IOCost model.
pub const PAGE_BYTES: f64 = 4096.0;
/// Where a log-structured device keeps its log (far from any volume's data region).
const LOG_REGION_BYTES: u64 = 1 << 50;
/// Distance from the previous I/O's end beyond which an I/O counts as random (IOCost: 16 MiB).
pub const SEQ_WINDOW_BYTES: u64 = headroom_qos::model::IOCOST_SEQ_DISTANCE_BYTES;

/// The six numbers of an IOCost `io.cost.model` line.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCostProfile {
    /// Sequential read bytes per second.
    pub rbps: f64,
    /// Sequential 4 KiB read IOPS.
    pub rseqiops: f64,
    /// Random 4 KiB read IOPS.
    pub rrandiops: f64,
    /// Sequential write bytes per second.
    pub wbps: f64,
    /// Sequential 4 KiB write IOPS.
    pub wseqiops: f64,
    /// Random 4 KiB write IOPS.
    pub wrandiops: f64,
}

impl IoCostProfile {
    /// Linux `autop[AUTOP_HDD]`.
    pub const HDD: IoCostProfile = IoCostProfile {
        rbps: 174_019_176.0,
        rseqiops: 41_708.0,
        rrandiops: 370.0,
        wbps: 178_075_866.0,
        wseqiops: 42_705.0,
        wrandiops: 378.0,
    };
    /// Linux `autop[AUTOP_SSD_QD1]`.
    pub const SSD_QD1: IoCostProfile = IoCostProfile {
        rbps: 245_855_193.0,
        rseqiops: 61_575.0,
        rrandiops: 6_946.0,
        wbps: 141_365_009.0,
        wseqiops: 33_716.0,
        wrandiops: 26_796.0,
    };
    /// Linux `autop[AUTOP_SSD_DFL]`.
    pub const SSD_DFL: IoCostProfile = IoCostProfile {
        rbps: 488_636_629.0,
        rseqiops: 8_932.0,
        rrandiops: 8_518.0,
        wbps: 427_891_549.0,
        wseqiops: 28_755.0,
        wrandiops: 21_940.0,
    };
    /// Linux `autop[AUTOP_SSD_FAST]`.
    pub const SSD_FAST: IoCostProfile = IoCostProfile {
        rbps: 3_102_524_156.0,
        rseqiops: 724_816.0,
        rrandiops: 778_122.0,
        wbps: 1_742_780_862.0,
        wseqiops: 425_702.0,
        wrandiops: 443_193.0,
    };

    /// A built-in profile by name (`hdd`, `ssd_qd1`, `ssd_dfl`, `ssd_fast`).
    pub fn builtin(name: &str) -> Option<IoCostProfile> {
        match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "hdd" => Some(Self::HDD),
            "ssd_qd1" => Some(Self::SSD_QD1),
            "ssd_dfl" => Some(Self::SSD_DFL),
            "ssd_fast" => Some(Self::SSD_FAST),
            _ => None,
        }
    }

    /// The linear coefficients of both directions (IOCost `calc_lcoefs`).
    pub fn coefficients(&self) -> (LinearCost, LinearCost) {
        (
            LinearCost::from_model(self.rbps, self.rseqiops, self.rrandiops),
            LinearCost::from_model(self.wbps, self.wseqiops, self.wrandiops),
        )
    }

    fn validate(&self) -> Result<(), SimError> {
        let all = [
            self.rbps,
            self.rseqiops,
            self.rrandiops,
            self.wbps,
            self.wseqiops,
            self.wrandiops,
        ];
        if all.iter().all(|v| v.is_finite() && *v > 0.0) {
            Ok(())
        } else {
            Err(SimError::Invalid(format!(
                "device iocost model needs six positive numbers, got {self:?}"
            )))
        }
    }
}

/// IOCost's linear cost of one direction, in nanoseconds of device time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearCost {
    /// Cost per 4 KiB page.
    pub page_ns: f64,
    /// Base cost of a sequential I/O.
    pub seq_base_ns: f64,
    /// Base cost of a random I/O.
    pub rand_base_ns: f64,
}

impl LinearCost {
    /// `calc_lcoefs`: page = 1 s / (bps / 4 KiB); base = max(1 s / iops - page, 0).
    pub fn from_model(bps: f64, seqiops: f64, randiops: f64) -> Self {
        let page_ns = 1e9 / (bps / PAGE_BYTES);
        LinearCost {
            page_ns,
            seq_base_ns: (1e9 / seqiops - page_ns).max(0.0),
            rand_base_ns: (1e9 / randiops - page_ns).max(0.0),
        }
    }

    /// Device time of one I/O of `len_bytes` (at least one page is charged).
    #[inline]
    pub fn cost_ns(&self, len_bytes: u32, sequential: bool) -> f64 {
        let pages = (f64::from(len_bytes) / PAGE_BYTES).max(1.0);
        let base = if sequential {
            self.seq_base_ns
        } else {
            self.rand_base_ns
        };
        base + pages * self.page_ns
    }
}

/// One point of a measured device curve.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CurvePoint {
    /// I/O size in KiB.
    pub size_kib: f64,
    /// Read IOPS achieved at that size (device saturated, one size only).
    pub read_iops: f64,
    /// Write IOPS achieved at that size.
    pub write_iops: f64,
}

/// How a device's cost per I/O is computed.
#[derive(Clone, Debug, PartialEq)]
pub enum CostCurve {
    /// IOCost linear model.
    Linear {
        /// Read coefficients.
        read: LinearCost,
        /// Write coefficients.
        write: LinearCost,
    },
    /// Measured achieved IOPS per size, interpolated linearly in log(size); no seq/rand split.
    Table(Vec<CurvePoint>),
}

impl CostCurve {
    /// Device time of one I/O, nanoseconds.
    #[inline]
    pub fn cost_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> f64 {
        match self {
            CostCurve::Linear { read, write } => match op {
                OpKind::Read => read.cost_ns(len_bytes, sequential),
                OpKind::Write | OpKind::WriteZeroes => write.cost_ns(len_bytes, sequential),
                OpKind::Flush | OpKind::Trim => 0.0,
            },
            CostCurve::Table(points) => match op {
                OpKind::Read => 1e9 / interpolate(points, len_bytes, |p| p.read_iops),
                OpKind::Write | OpKind::WriteZeroes => {
                    1e9 / interpolate(points, len_bytes, |p| p.write_iops)
                }
                OpKind::Flush | OpKind::Trim => 0.0,
            },
        }
    }
}

fn interpolate(points: &[CurvePoint], len_bytes: u32, f: impl Fn(&CurvePoint) -> f64) -> f64 {
    let kib = (f64::from(len_bytes) / 1024.0).max(1e-3);
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return 1.0;
    };
    if kib <= first.size_kib {
        return f(first);
    }
    if kib >= last.size_kib {
        // Beyond the table, bandwidth stays at the last point's.
        return f(last) * last.size_kib / kib;
    }
    for w in points.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if kib <= b.size_kib {
            let t = (kib.ln() - a.size_kib.ln()) / (b.size_kib.ln() - a.size_kib.ln());
            return (f(a).ln() + t * (f(b).ln() - f(a).ln())).exp();
        }
    }
    f(last)
}

/// Where a device puts written data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Data is written where its offset says (random writes stay random).
    #[default]
    InPlace,
    /// Log-structured: every write appends at the log head, so writes are always sequential.
    Log,
}

/// Scenario description of a device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Built-in IOCost profile name (`hdd`, `ssd_qd1`, `ssd_dfl`, `ssd_fast`).
    #[serde(default)]
    pub profile: Option<String>,
    /// Explicit IOCost model (instead of `profile`).
    #[serde(default)]
    pub iocost: Option<IoCostProfile>,
    /// Measured curve (instead of `profile`), sizes ascending.
    #[serde(default)]
    pub curve: Option<Vec<CurvePoint>>,
    /// Multiplies the device's speed (e.g. 4.0 = four such devices striped inside one box).
    #[serde(default = "one_f64")]
    pub speedup: f64,
    /// Most I/Os in flight at once (0 = unbounded).
    #[serde(default)]
    pub parallelism: u32,
    /// Read slowdown per write in flight, relative to `parallelism` (or per 32 writes when
    /// unbounded): 1.0 = a read next to a device full of writes takes twice as long.
    #[serde(default)]
    pub rw_interference: f64,
    /// Access latency hidden by overlap (flash access, a backend round trip), ns.
    #[serde(default)]
    pub latency_ns: u64,
    /// Data layout.
    #[serde(default)]
    pub layout: Layout,
    /// Sequential streams the device recognises at once (readahead / cache segments of a
    /// disk): an I/O is sequential if it continues any of the last `streams` I/O ends.
    /// 1 = IOCost's single cursor.
    #[serde(default = "one_u32")]
    pub streams: u32,
    /// Number of identical devices this entry stands for.
    #[serde(default = "one_u32")]
    pub count: u32,
}

fn one_f64() -> f64 {
    1.0
}
fn one_u32() -> u32 {
    1
}

impl DeviceSpec {
    /// The cost curve of this spec.
    pub fn curve(&self) -> Result<CostCurve, SimError> {
        let chosen = [
            self.profile.is_some(),
            self.iocost.is_some(),
            self.curve.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count();
        if chosen != 1 {
            return Err(SimError::Invalid(
                "a device needs exactly one of `profile`, `iocost` or `curve`".into(),
            ));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(SimError::Invalid(format!(
                "device speedup must be > 0, got {}",
                self.speedup
            )));
        }
        let scale = |c: LinearCost| LinearCost {
            page_ns: c.page_ns / self.speedup,
            seq_base_ns: c.seq_base_ns / self.speedup,
            rand_base_ns: c.rand_base_ns / self.speedup,
        };
        if let Some(name) = &self.profile {
            let p = IoCostProfile::builtin(name).ok_or_else(|| {
                SimError::Invalid(format!(
                    "unknown device profile {name:?} (expected hdd, ssd_qd1, ssd_dfl, ssd_fast)"
                ))
            })?;
            let (read, write) = p.coefficients();
            return Ok(CostCurve::Linear {
                read: scale(read),
                write: scale(write),
            });
        }
        if let Some(p) = &self.iocost {
            p.validate()?;
            let (read, write) = p.coefficients();
            return Ok(CostCurve::Linear {
                read: scale(read),
                write: scale(write),
            });
        }
        let points = self.curve.clone().unwrap_or_default();
        if points.is_empty() {
            return Err(SimError::Invalid("device curve is empty".into()));
        }
        for w in points.windows(2) {
            if w[1].size_kib <= w[0].size_kib {
                return Err(SimError::Invalid(
                    "device curve sizes must be strictly ascending".into(),
                ));
            }
        }
        for p in &points {
            let ok = [p.size_kib, p.read_iops, p.write_iops]
                .iter()
                .all(|v| v.is_finite() && *v > 0.0);
            if !ok {
                return Err(SimError::Invalid(format!(
                    "device curve point {p:?} must be positive"
                )));
            }
        }
        Ok(CostCurve::Table(
            points
                .into_iter()
                .map(|p| CurvePoint {
                    read_iops: p.read_iops * self.speedup,
                    write_iops: p.write_iops * self.speedup,
                    ..p
                })
                .collect(),
        ))
    }
}

/// Timing of one I/O on a device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Service {
    /// When a channel started serving it.
    pub start_ns: u64,
    /// When it completed (including the access latency).
    pub done_ns: u64,
    /// Device time it used, ns.
    pub cost_ns: f64,
}

/// A device in the simulation. I/Os must be submitted in non-decreasing time order (the node
/// model guarantees it), which lets the start and end of each I/O be computed at submission
/// without further events.
#[derive(Debug)]
pub struct Device {
    curve: CostCurve,
    parallelism: usize,
    rw_interference: f64,
    interference_scale: f64,
    latency_ns: u64,
    layout: Layout,
    /// When the throughput server is free.
    server_free_ns: u64,
    /// Completion times of I/Os in flight (only kept when `parallelism > 0`).
    in_flight: BinaryHeap<Reverse<u64>>,
    /// Completion times of writes in flight (only kept when interference is on).
    writes_in_flight: BinaryHeap<Reverse<u64>>,
    log_head_bytes: u64,
    /// Where recent streams ended: an I/O near one of them is sequential (the same tracker
    /// as the server's emulated devices).
    streams: StreamTracker,
    /// Total device time used (sum of costs), ns.
    pub busy_ns: f64,
    /// I/Os served.
    pub ops: u64,
}

impl Device {
    /// A device from a validated curve.
    pub fn new(spec: &DeviceSpec, curve: CostCurve) -> Device {
        let parallelism = spec.parallelism as usize;
        Device {
            curve,
            parallelism,
            rw_interference: spec.rw_interference.max(0.0),
            interference_scale: if parallelism > 0 {
                parallelism as f64
            } else {
                32.0
            },
            latency_ns: spec.latency_ns,
            layout: spec.layout,
            server_free_ns: 0,
            in_flight: BinaryHeap::with_capacity(parallelism),
            writes_in_flight: BinaryHeap::new(),
            log_head_bytes: LOG_REGION_BYTES,
            streams: StreamTracker::new(spec.streams as usize, SEQ_WINDOW_BYTES),
            busy_ns: 0.0,
            ops: 0,
        }
    }

    /// Device time of an I/O as it would be charged now (without side effects).
    pub fn cost_ns(&self, op: OpKind, len_bytes: u32, sequential: bool) -> f64 {
        self.curve.cost_ns(op, len_bytes, sequential)
    }

    /// I/Os queued or in service at `now_ns` (what a read router sees of this device).
    pub fn in_flight_at(&self, now_ns: u64) -> u32 {
        if self.parallelism > 0 {
            self.in_flight
                .iter()
                .filter(|Reverse(t)| *t > now_ns)
                .count() as u32
        } else {
            u32::from(self.server_free_ns > now_ns)
        }
    }

    /// Serves one I/O arriving at `at_ns`.
    pub fn submit(&mut self, at_ns: u64, op: OpKind, offset_bytes: u64, len_bytes: u32) -> Service {
        let is_write = matches!(op, OpKind::Write | OpKind::WriteZeroes);
        let sequential = if is_write && self.layout == Layout::Log {
            // Appends at the log head (charged as sequential: the log absorbs random writes),
            // which is where the disk head ends up, so a following read seeks.
            self.log_head_bytes =
                LOG_REGION_BYTES + (self.log_head_bytes + u64::from(len_bytes)) % LOG_REGION_BYTES;
            self.streams.move_head(self.log_head_bytes);
            true
        } else {
            self.streams.observe(offset_bytes, u64::from(len_bytes))
        };
        let mut cost = self.curve.cost_ns(op, len_bytes, sequential);
        if cost <= 0.0 {
            return Service {
                start_ns: at_ns,
                done_ns: at_ns + self.latency_ns,
                cost_ns: 0.0,
            };
        }
        let mut start = at_ns.max(self.server_free_ns);
        if self.parallelism > 0 {
            if self.in_flight.len() >= self.parallelism
                && let Some(Reverse(t)) = self.in_flight.pop()
            {
                // Wait for a slot: the earliest in-flight I/O to finish.
                start = start.max(t);
            }
            while let Some(Reverse(t)) = self.in_flight.peek() {
                if *t <= start {
                    self.in_flight.pop();
                } else {
                    break;
                }
            }
        }
        if self.rw_interference > 0.0 {
            while let Some(Reverse(end)) = self.writes_in_flight.peek() {
                if *end <= start {
                    self.writes_in_flight.pop();
                } else {
                    break;
                }
            }
            if !is_write {
                let busy = self.writes_in_flight.len() as f64;
                cost *= 1.0 + self.rw_interference * busy / self.interference_scale;
            }
        }
        let hold = crate::fastmath::round_u64(cost).max(1);
        self.server_free_ns = start + hold;
        let done = start + hold + self.latency_ns;
        if self.parallelism > 0 {
            self.in_flight.push(Reverse(done));
        }
        if is_write && self.rw_interference > 0.0 {
            self.writes_in_flight.push(Reverse(done));
        }
        self.busy_ns += cost;
        self.ops += 1;
        Service {
            start_ns: start,
            done_ns: done,
            cost_ns: cost,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(profile: &str, k: u32) -> DeviceSpec {
        DeviceSpec {
            profile: Some(profile.into()),
            iocost: None,
            curve: None,
            speedup: 1.0,
            parallelism: k,
            rw_interference: 0.0,
            latency_ns: 0,
            layout: Layout::InPlace,
            streams: 1,
            count: 1,
        }
    }

    #[test]
    fn iocost_coefficients_match_the_reference_table() {
        // docs/background.md §6: SSD_DFL read page 8.4 / seq 103.6 / rand 109.0 µs;
        // 4 KiB random read ≈ 117 µs, 128 KiB sequential read ≈ 372 µs.
        let (r, w) = IoCostProfile::SSD_DFL.coefficients();
        assert!((r.page_ns / 1e3 - 8.4).abs() < 0.05);
        assert!((r.seq_base_ns / 1e3 - 103.6).abs() < 0.1);
        assert!((r.rand_base_ns / 1e3 - 109.0).abs() < 0.1);
        assert!((w.rand_base_ns / 1e3 - 36.0).abs() < 0.1);
        assert!((r.cost_ns(4096, false) / 1e3 - 117.4).abs() < 0.5);
        assert!((r.cost_ns(128 << 10, true) / 1e3 - 372.0).abs() < 1.0);
        let (hr, _) = IoCostProfile::HDD.coefficients();
        assert!((hr.rand_base_ns / 1e3 - 2679.0).abs() < 1.0);
    }

    #[test]
    fn saturated_device_runs_at_one_over_cost() {
        let s = spec("ssd_dfl", 8);
        let mut d = Device::new(&s, s.curve().unwrap());
        let n = 10_000u64;
        let mut last = 0;
        for i in 0..n {
            // Random offsets far apart: every read is random.
            last = d.submit(0, OpKind::Read, i * (1 << 30), 4096).done_ns;
        }
        let iops = n as f64 / (last as f64 / 1e9);
        assert!((iops - 8_518.0).abs() / 8_518.0 < 0.01, "iops {iops}");
    }

    #[test]
    fn lone_io_takes_cost_plus_latency_and_parallelism_bounds_overlap() {
        let mut s = spec("ssd_fast", 2);
        s.latency_ns = 80_000;
        let mut d = Device::new(&s, s.curve().unwrap());
        let c = d.cost_ns(OpKind::Read, 4096, false).round() as u64;
        let a = d.submit(1_000, OpKind::Read, 1 << 40, 4096);
        assert_eq!(a.done_ns, 1_000 + c + 80_000);
        // The second overlaps the first's latency; the third waits for a free slot.
        let b = d.submit(1_000, OpKind::Read, 3 << 40, 4096);
        assert_eq!(b.start_ns, 1_000 + c);
        let third = d.submit(1_000, OpKind::Read, 5 << 40, 4096);
        assert_eq!(third.start_ns, a.done_ns);
    }

    #[test]
    fn interleaved_sequential_streams_become_random() {
        let s = spec("hdd", 1);
        let mut alone = Device::new(&s, s.curve().unwrap());
        let mut t = 0;
        for i in 0..100u64 {
            t = alone.submit(t, OpKind::Read, i * 4096, 4096).done_ns;
        }
        let mut mixed = Device::new(&s, s.curve().unwrap());
        let mut t2 = 0;
        for i in 0..100u64 {
            let base = if i % 2 == 0 { 0 } else { 10 << 30 };
            t2 = mixed
                .submit(t2, OpKind::Read, base + (i / 2) * 4096, 4096)
                .done_ns;
        }
        assert!(t2 > 50 * t, "alone {t} mixed {t2}");
    }

    #[test]
    fn stream_slots_keep_interleaved_scans_sequential() {
        let mut s = spec("hdd", 1);
        s.streams = 4;
        let mut d = Device::new(&s, s.curve().unwrap());
        let mut t = 0;
        for i in 0..100u64 {
            let base = if i % 2 == 0 { 0 } else { 10 << 30 };
            t = d
                .submit(t, OpKind::Read, base + (i / 2) * 4096, 4096)
                .done_ns;
        }
        // Two interleaved scans: only the first I/O of each seeks.
        let seq = d.cost_ns(OpKind::Read, 4096, true);
        let rand = d.cost_ns(OpKind::Read, 4096, false);
        let want = 2.0 * rand + 98.0 * seq;
        assert!((t as f64 - want).abs() / want < 0.01, "{t} vs {want}");
    }

    #[test]
    fn writes_slow_reads_when_interference_is_on() {
        let mut s = spec("ssd_fast", 4);
        s.rw_interference = 1.0;
        s.latency_ns = 1_000_000;
        let mut d = Device::new(&s, s.curve().unwrap());
        for i in 0..3 {
            d.submit(0, OpKind::Write, i << 30, 128 << 10);
        }
        let r = d.submit(0, OpKind::Read, 7 << 30, 4096);
        let base = d.cost_ns(OpKind::Read, 4096, false);
        let took = (r.done_ns - r.start_ns - 1_000_000) as f64;
        assert!((took / base - 1.75).abs() < 0.01, "ratio {}", took / base);
    }

    #[test]
    fn curve_interpolates_and_validates() {
        let mut s = spec("hdd", 1);
        s.profile = None;
        s.curve = Some(vec![
            CurvePoint {
                size_kib: 1.0,
                read_iops: 100_000.0,
                write_iops: 50_000.0,
            },
            CurvePoint {
                size_kib: 256.0,
                read_iops: 2_000.0,
                write_iops: 1_000.0,
            },
        ]);
        let c = s.curve().unwrap();
        let at16 = 1e9 / c.cost_ns(OpKind::Read, 16 << 10, false);
        // halfway in log-size: geometric mean of 100k and 2k
        assert!(
            (at16 - (100_000.0f64 * 2_000.0).sqrt()).abs() < 1.0,
            "{at16}"
        );
        s.curve = Some(vec![]);
        assert!(s.curve().is_err());
        s.curve = None;
        assert!(s.curve().is_err());
    }
}
