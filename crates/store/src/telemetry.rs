//! Device telemetry: what each device is doing *now* — its read and write rates, the mean
//! time its operations take, and what a written byte costs against a read one — smoothed so
//! that one busy or idle moment does not swing it.
//!
//! Why: the device counters (`stats`) are totals since start, fit for `/metrics` and
//! `rate()`, but placing an extent, routing a read to a replica or pacing a rebuild needs the
//! current state of every device, on the node, without a metrics server in between. Flint
//! (NSDI'25) keeps such a "shadow view" of every SSD for its allocator and its scheduler;
//! this is ours (docs/ARCHITECTURE.md, decision 21).
//!
//! How: the node's sampler calls [`TelemetryState::observe`] once per interval with the
//! device's counters and the time (an argument: nothing here reads a clock). The difference
//! from the previous call gives the window's rates and mean latencies, which enter an
//! exponentially weighted moving average with [`EWMA_ALPHA`] per window (the first window is
//! taken as it is). Rates decay towards zero in idle windows; latencies and the write cost
//! keep their last value until operations measure them again. `version` grows by one for
//! every window in which the device completed an operation, so a reader can tell new
//! information from old (Flint's recency counter).
//!
//! Write cost: the mean time per KiB written over the mean time per KiB read, both from the
//! smoothed figures. 1.0 means a written byte costs what a read one does; flash under
//! garbage collection shows several. Unknown (`None`) until both reads and writes were timed;
//! RAM devices are not timed, so theirs stays unknown.

use serde::{Deserialize, Serialize};

use crate::stats::{DeviceOp, DeviceOpStats};

/// Weight of the newest window in the moving averages (Flint uses 0.3 on 200 ms windows).
pub const EWMA_ALPHA: f64 = 0.3;

/// One device's smoothed view.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceTelemetry {
    /// Windows in which the device completed at least one operation.
    pub version: u64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    /// Written and zeroed bytes per second.
    pub write_bytes_per_s: f64,
    /// Mean time of a read, µs; `None` until reads were timed (never on RAM devices).
    pub read_latency_us: Option<f64>,
    /// Mean time of a write, µs; `None` until writes were timed.
    pub write_latency_us: Option<f64>,
    /// Time per KiB written over time per KiB read; `None` until both were timed.
    pub write_cost: Option<f64>,
    /// Failed operations per second.
    pub errors_per_s: f64,
    /// Length of the last window, ns.
    pub window_ns: u64,
}

impl DeviceTelemetry {
    /// Seconds of device time per second (reads and writes at their mean latency): how busy
    /// the device is, 1 = always one operation in progress. 0 when untimed (RAM devices).
    pub fn busy_fraction(&self) -> f64 {
        let read = self.read_iops * self.read_latency_us.unwrap_or(0.0) / 1e6;
        let write = self.write_iops * self.write_latency_us.unwrap_or(0.0) / 1e6;
        read + write
    }
}

/// The telemetry of one device and the counters it was last computed from.
#[derive(Clone, Debug, Default)]
pub(crate) struct TelemetryState {
    last: Option<(u64, [DeviceOpStats; 5])>,
    current: DeviceTelemetry,
    /// Smoothed mean bytes per read and per write (for the write cost).
    read_bytes_per_op: Option<f64>,
    write_bytes_per_op: Option<f64>,
}

fn ewma(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(old) => old + EWMA_ALPHA * (new - old),
        None => new,
    }
}

/// What one operation did in a window: operations, bytes, timed operations, their time.
#[derive(Clone, Copy, Default)]
struct Window {
    ops: u64,
    bytes: u64,
    timed_ops: u64,
    time_ns: u64,
    errors: u64,
}

impl Window {
    fn between(old: &DeviceOpStats, new: &DeviceOpStats) -> Window {
        Window {
            ops: new.ops.saturating_sub(old.ops),
            bytes: new.bytes.saturating_sub(old.bytes),
            timed_ops: new.latency.count().saturating_sub(old.latency.count()),
            time_ns: new.latency.sum_ns.saturating_sub(old.latency.sum_ns),
            errors: new.errors.saturating_sub(old.errors),
        }
    }

    fn add(self, other: Window) -> Window {
        Window {
            ops: self.ops + other.ops,
            bytes: self.bytes + other.bytes,
            timed_ops: self.timed_ops + other.timed_ops,
            time_ns: self.time_ns + other.time_ns,
            errors: self.errors + other.errors,
        }
    }

    fn mean_us(self) -> Option<f64> {
        (self.timed_ops > 0).then(|| self.time_ns as f64 / self.timed_ops as f64 / 1e3)
    }
}

impl TelemetryState {
    /// Takes the device's counters at `now_ns` (any monotonic origin, the same every call).
    /// The first call only remembers them; a call at or before the previous time is ignored.
    pub(crate) fn observe(&mut self, now_ns: u64, ops: &[DeviceOpStats; 5]) {
        let Some((then_ns, previous)) = self.last else {
            self.last = Some((now_ns, *ops));
            return;
        };
        if now_ns <= then_ns {
            return;
        }
        self.last = Some((now_ns, *ops));
        let window_s = (now_ns - then_ns) as f64 / 1e9;
        let of = |op: DeviceOp| Window::between(&previous[op as usize], &ops[op as usize]);
        let read = of(DeviceOp::Read);
        let write = of(DeviceOp::Write).add(of(DeviceOp::Zero));
        let errors = DeviceOp::ALL.iter().map(|&op| of(op).errors).sum::<u64>();
        let any = DeviceOp::ALL.iter().any(|&op| of(op).ops > 0);
        let first = self.current.window_ns == 0;
        let smooth = |old: f64, new: f64| if first { new } else { ewma(Some(old), new) };
        let t = &mut self.current;
        t.read_iops = smooth(t.read_iops, read.ops as f64 / window_s);
        t.write_iops = smooth(t.write_iops, write.ops as f64 / window_s);
        t.read_bytes_per_s = smooth(t.read_bytes_per_s, read.bytes as f64 / window_s);
        t.write_bytes_per_s = smooth(t.write_bytes_per_s, write.bytes as f64 / window_s);
        t.errors_per_s = smooth(t.errors_per_s, errors as f64 / window_s);
        if let Some(us) = read.mean_us() {
            t.read_latency_us = Some(ewma(t.read_latency_us, us));
        }
        if let Some(us) = write.mean_us() {
            t.write_latency_us = Some(ewma(t.write_latency_us, us));
        }
        if read.ops > 0 {
            let per_op = read.bytes as f64 / read.ops as f64;
            self.read_bytes_per_op = Some(ewma(self.read_bytes_per_op, per_op));
        }
        if write.ops > 0 {
            let per_op = write.bytes as f64 / write.ops as f64;
            self.write_bytes_per_op = Some(ewma(self.write_bytes_per_op, per_op));
        }
        t.write_cost = match (
            t.read_latency_us,
            t.write_latency_us,
            self.read_bytes_per_op,
            self.write_bytes_per_op,
        ) {
            (Some(r_us), Some(w_us), Some(r_bytes), Some(w_bytes))
                if r_us > 0.0 && r_bytes > 0.0 && w_bytes > 0.0 =>
            {
                Some((w_us / w_bytes) / (r_us / r_bytes))
            }
            _ => t.write_cost,
        };
        if any {
            t.version += 1;
        }
        t.window_ns = now_ns - then_ns;
    }

    /// The smoothed view as of the last window.
    pub(crate) fn current(&self) -> DeviceTelemetry {
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::LatencySnapshot;

    /// Counters after `reads` reads and `writes` writes of `bytes` each, taking `read_ns` and
    /// `write_ns` each (0: untimed).
    fn counters(
        reads: u64,
        writes: u64,
        bytes: u64,
        read_ns: u64,
        write_ns: u64,
    ) -> [DeviceOpStats; 5] {
        let mut out = [DeviceOpStats::default(); 5];
        let timed = |n: u64, ns: u64| {
            let mut l = LatencySnapshot::default();
            if ns > 0 {
                l.buckets[0] = n;
                l.sum_ns = n * ns;
            }
            l
        };
        out[DeviceOp::Read as usize] = DeviceOpStats {
            ops: reads,
            errors: 0,
            no_space: 0,
            bytes: reads * bytes,
            latency: timed(reads, read_ns),
        };
        out[DeviceOp::Write as usize] = DeviceOpStats {
            ops: writes,
            errors: 0,
            no_space: 0,
            bytes: writes * bytes,
            latency: timed(writes, write_ns),
        };
        out
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_first_call_only_remembers_and_the_first_window_is_taken_as_it_is() {
        let mut t = TelemetryState::default();
        t.observe(0, &counters(100, 0, 4096, 0, 0));
        assert_eq!(t.current(), DeviceTelemetry::default());
        t.observe(S, &counters(1100, 500, 4096, 0, 0));
        let c = t.current();
        assert_eq!(c.version, 1);
        assert_eq!(c.read_iops, 1000.0);
        assert_eq!(c.write_iops, 500.0);
        assert_eq!(c.read_bytes_per_s, 1000.0 * 4096.0);
        assert_eq!(c.window_ns, S);
        // Untimed (a RAM device): no latency, no write cost.
        assert_eq!(c.read_latency_us, None);
        assert_eq!(c.write_cost, None);
    }

    #[test]
    fn rates_move_by_alpha_and_decay_when_idle_while_latency_keeps_its_value() {
        let mut t = TelemetryState::default();
        t.observe(0, &counters(0, 0, 4096, 100_000, 300_000));
        t.observe(S, &counters(1000, 1000, 4096, 100_000, 300_000));
        assert_eq!(t.current().read_iops, 1000.0);
        // A window twice as busy: 1000 + 0.3 × (2000 − 1000).
        t.observe(2 * S, &counters(3000, 1000, 4096, 100_000, 300_000));
        let c = t.current();
        assert!((c.read_iops - 1300.0).abs() < 1e-9, "{}", c.read_iops);
        // Writes idle in that window: 1000 × 0.7.
        assert!((c.write_iops - 700.0).abs() < 1e-9, "{}", c.write_iops);
        assert_eq!(c.version, 2);
        // An idle window: rates decay, the version stays, latencies stay.
        t.observe(3 * S, &counters(3000, 1000, 4096, 100_000, 300_000));
        let idle = t.current();
        assert_eq!(idle.version, 2);
        assert!((idle.read_iops - 910.0).abs() < 1e-9);
        assert_eq!(idle.read_latency_us, c.read_latency_us);
        assert_eq!(idle.write_cost, c.write_cost);
    }

    #[test]
    fn write_cost_is_time_per_kib_written_over_time_per_kib_read() {
        let mut t = TelemetryState::default();
        t.observe(0, &counters(0, 0, 4096, 100_000, 300_000));
        t.observe(S, &counters(10, 10, 4096, 100_000, 300_000));
        let c = t.current();
        assert_eq!(c.read_latency_us, Some(100.0));
        assert_eq!(c.write_latency_us, Some(300.0));
        // 10 reads of 100 µs and 10 writes of 300 µs in a second: 4 ms busy.
        assert!(
            (c.busy_fraction() - 0.004).abs() < 1e-12,
            "{}",
            c.busy_fraction()
        );
        let cost = c.write_cost.expect("both timed");
        assert!((cost - 3.0).abs() < 1e-9, "{cost}");
    }

    #[test]
    fn a_clock_that_does_not_advance_changes_nothing() {
        let mut t = TelemetryState::default();
        t.observe(S, &counters(0, 0, 4096, 0, 0));
        t.observe(2 * S, &counters(10, 0, 4096, 0, 0));
        let before = t.current();
        t.observe(2 * S, &counters(1000, 0, 4096, 0, 0));
        t.observe(S, &counters(2000, 0, 4096, 0, 0));
        assert_eq!(t.current(), before);
    }
}
