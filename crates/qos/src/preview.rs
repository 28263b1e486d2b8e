//! Preview: how a storage class answers a steady demand, second by second.
//!
//! Operators ask "if this gp2 volume is hit with 3,000 IOPS, what happens?". The answer must
//! come from the shipped scheduler, not from a formula that might disagree with it, so the
//! preview runs the Credit policy itself (same buckets, same limiters) against a synthetic
//! client on an otherwise idle node and reports one row per second. `headroom qos preview`
//! prints these rows.
//!
//! The client issues request `k` at `ceil(k × 10⁹ / rate)` ns (the demand), keeps at most
//! [`PREVIEW_QUEUE_DEPTH`] requests queued (a request that cannot be queued is issued as soon as
//! there is room, like fio's `iodepth` with `rate_iops`), and every dispatched request
//! completes at once (an infinitely fast device), so the rows show the QoS class alone.

use crate::cost::CostVector;
use crate::engine::Engine;
use crate::error::QosError;
use crate::policies::credit::CreditRules;
use crate::policy::Policy;
use crate::presets::Preset;
use crate::vocab::{Decision, IoRequest, NS_PER_S, NodeCapacity, Observed, OpKind};
use serde::Serialize;

/// Requests the synthetic client keeps queued at most.
pub const PREVIEW_QUEUE_DEPTH: u64 = 64;
/// Largest number of requests one preview may simulate.
pub const PREVIEW_MAX_REQUESTS: u64 = 200_000_000;
/// Longest preview, seconds (one week).
pub const PREVIEW_MAX_SECONDS: u64 = 7 * 24 * 3600;
/// Largest request (the NBD protocol's usual 32 MiB cap).
pub const PREVIEW_MAX_IO_BYTES: u64 = 32 * 1024 * 1024;

/// What to preview.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreviewRequest {
    /// The storage class.
    pub preset: Preset,
    /// Volume size, bytes.
    pub size_bytes: u64,
    /// Demand in requests per second (`None`: not limited by IOPS).
    pub demand_iops: Option<u64>,
    /// Demand in payload bytes per second (`None`: not limited by bytes).
    pub demand_bytes_per_s: Option<u64>,
    /// Size of every request, bytes.
    pub io_size_bytes: u64,
    /// Number of one-second rows.
    pub seconds: u64,
}

/// One second of the preview.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PreviewRow {
    /// Start of the second, seconds since the volume was created (the row covers `[t_s, t_s + 1)`).
    pub t_s: u64,
    /// Requests completed during the second.
    pub iops: u64,
    /// Payload bytes completed during the second.
    pub bytes_per_s: u64,
    /// Whole credits left at the end of the second: the IOPS bucket, else the bytes bucket;
    /// `None` if the class has no credit bucket.
    pub credit_balance: Option<u64>,
}

const VOLUME: u32 = 1;

/// Arrival time of request `k` under the demand (the later of both limits), ns.
fn arrival_ns(k: u64, io_size: u64, demand_iops: Option<u64>, demand_bps: Option<u64>) -> u64 {
    let by_iops = demand_iops.map_or(0, |r| crate::cost::mul_div_ceil(k, NS_PER_S, r));
    let by_bytes = demand_bps.map_or(0, |r| {
        let v =
            (u128::from(k) * u128::from(io_size) * u128::from(NS_PER_S)).div_ceil(u128::from(r));
        u64::try_from(v).unwrap_or(u64::MAX)
    });
    by_iops.max(by_bytes)
}

/// Runs the preview.
pub fn preview(req: &PreviewRequest) -> Result<Vec<PreviewRow>, QosError> {
    let bad = |m: String| Err(QosError::InvalidPreview(m));
    if req.seconds == 0 || req.seconds > PREVIEW_MAX_SECONDS {
        return bad(format!(
            "seconds must be 1..={PREVIEW_MAX_SECONDS}, not {}",
            req.seconds
        ));
    }
    if req.io_size_bytes == 0 || req.io_size_bytes > PREVIEW_MAX_IO_BYTES {
        return bad(format!(
            "io size must be 1..={PREVIEW_MAX_IO_BYTES} bytes, not {}",
            req.io_size_bytes
        ));
    }
    if req.demand_iops == Some(0) || req.demand_bytes_per_s == Some(0) {
        return bad("a demand of zero previews nothing; omit it or give a positive rate".into());
    }
    let qos = req.preset.volume_qos(req.size_bytes)?;
    // Upper bound on requests: the demand if given, else the class's ceiling.
    let ceiling_reqs = {
        let c = qos.burst_ceiling();
        let by_units = c.iops;
        let by_bytes = if c.bytes_per_s == u64::MAX {
            u64::MAX
        } else {
            c.bytes_per_s / req.io_size_bytes + 1
        };
        by_units.min(by_bytes)
    };
    let demand_reqs = match (req.demand_iops, req.demand_bytes_per_s) {
        (None, None) => u64::MAX,
        (a, b) => a
            .unwrap_or(u64::MAX)
            .min(b.map_or(u64::MAX, |b| b / req.io_size_bytes + 1)),
    };
    let per_s = demand_reqs.min(ceiling_reqs);
    if per_s == u64::MAX {
        return bad("unbounded demand against a class without a ceiling: give --demand-iops or --demand-mbps".into());
    }
    if per_s.saturating_mul(req.seconds) > PREVIEW_MAX_REQUESTS {
        return bad(format!(
            "about {} requests to simulate (limit {PREVIEW_MAX_REQUESTS}); use fewer seconds or a lower demand",
            per_s.saturating_mul(req.seconds)
        ));
    }
    let len_bytes = u32::try_from(req.io_size_bytes)
        .map_err(|_| QosError::InvalidPreview("io size too large".into()))?;

    let params = crate::policy::PolicyParams::default();
    let mut engine = Engine::new(
        CreditRules::new(params.limiter_depth_ns),
        NodeCapacity::UNLIMITED,
        params.window_ns,
        params.limiter_depth_ns,
        params.track_invariants,
    );
    engine.add_volume(0, VOLUME, &qos);
    let end_ns = req.seconds.saturating_mul(NS_PER_S);
    let mut rows: Vec<PreviewRow> = (0..req.seconds)
        .map(|t_s| PreviewRow {
            t_s,
            iops: 0,
            bytes_per_s: 0,
            credit_balance: None,
        })
        .collect();
    let balance = |e: &Engine<CreditRules>, t: u64| {
        let (iops, bytes) = e.credits_at(VOLUME, t);
        iops.or(bytes)
    };
    let mut now = 0u64;
    let mut next_k = 0u64;
    let mut queued = 0u64;
    let mut row = 0usize;
    loop {
        while queued < PREVIEW_QUEUE_DEPTH {
            let t = arrival_ns(
                next_k,
                req.io_size_bytes,
                req.demand_iops,
                req.demand_bytes_per_s,
            );
            if t > now {
                break;
            }
            engine.enqueue(
                now,
                IoRequest {
                    id: next_k,
                    volume: VOLUME,
                    op: OpKind::Read,
                    offset_bytes: next_k.wrapping_mul(req.io_size_bytes) % req.size_bytes.max(1),
                    len_bytes,
                    cost: CostVector::ZERO,
                    arrival_ns: t,
                },
            );
            next_k += 1;
            queued += 1;
        }
        let wake = match engine.next(now) {
            Decision::Dispatch(r, _) => {
                queued -= 1;
                if let Some(cell) = rows.get_mut(row) {
                    cell.iops += 1;
                    cell.bytes_per_s += u64::from(r.len_bytes);
                }
                engine.complete(now, &r, Observed::default());
                continue;
            }
            Decision::WaitUntil(t) => t,
            Decision::Idle => u64::MAX,
        };
        let arrival = if queued < PREVIEW_QUEUE_DEPTH {
            arrival_ns(
                next_k,
                req.io_size_bytes,
                req.demand_iops,
                req.demand_bytes_per_s,
            )
        } else {
            u64::MAX
        };
        let next = wake.min(arrival).max(now + 1);
        // Close every second that ends at or before the next event.
        while row < rows.len() && (row as u64 + 1) * NS_PER_S <= next {
            rows[row].credit_balance = balance(&engine, (row as u64 + 1) * NS_PER_S);
            row += 1;
        }
        if next >= end_ns || row >= rows.len() {
            break;
        }
        now = next;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn run(preset: &str, size_bytes: u64, demand_iops: u64, seconds: u64) -> Vec<PreviewRow> {
        preview(&PreviewRequest {
            preset: Preset::parse(preset).unwrap(),
            size_bytes,
            demand_iops: Some(demand_iops),
            demand_bytes_per_s: None,
            io_size_bytes: 4096,
            seconds,
        })
        .unwrap()
    }

    #[test]
    fn qemu_timeline_bursts_12_5_s_then_holds_avg() {
        let rows = run(
            "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10",
            GIB,
            10_000,
            30,
        );
        for r in &rows[..12] {
            assert_eq!(r.iops, 5_000, "second {}", r.t_s);
        }
        // Second 12 is half burst (12.0–12.5 s at 5,000/s) and half baseline (12.5–13 s at 1,000/s).
        assert_eq!(rows[12].iops, 2_500 + 500);
        for r in &rows[13..] {
            assert_eq!(r.iops, 1_000, "second {}", r.t_s);
        }
        // The bucket drains 4,000 credits/s from 50,000: 2,000 left after 12 s, then empty.
        assert_eq!(rows[0].credit_balance, Some(46_000));
        assert_eq!(rows[11].credit_balance, Some(2_000));
        assert_eq!(rows[12].credit_balance, Some(0));
        assert_eq!(rows[29].bytes_per_s, 1_000 * 4096);
    }

    #[test]
    fn demand_below_baseline_is_served_and_keeps_credits_full() {
        let rows = run(
            "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10",
            GIB,
            800,
            5,
        );
        assert!(
            rows.iter()
                .all(|r| r.iops == 800 && r.credit_balance == Some(50_000))
        );
    }

    #[test]
    fn bytes_demand_and_classes_without_credits() {
        let rows = preview(&PreviewRequest {
            preset: Preset::parse("gp3").unwrap(),
            size_bytes: 100 * GIB,
            demand_iops: None,
            demand_bytes_per_s: Some(1 << 30),
            io_size_bytes: 1 << 20,
            seconds: 3,
        })
        .unwrap();
        // gp3 default 125 MiB/s cap with 1 MiB requests (4 AWS units each, 750 of 3,000 IOPS).
        assert!(
            rows.iter()
                .all(|r| r.iops == 125 && r.bytes_per_s == 125 << 20 && r.credit_balance.is_none())
        );
    }

    #[test]
    fn rejects_bad_requests() {
        let base = PreviewRequest {
            preset: Preset::Gp2,
            size_bytes: 100 * GIB,
            demand_iops: Some(3_000),
            demand_bytes_per_s: None,
            io_size_bytes: 4096,
            seconds: 10,
        };
        for r in [
            PreviewRequest {
                seconds: 0,
                ..base.clone()
            },
            PreviewRequest {
                io_size_bytes: 0,
                ..base.clone()
            },
            PreviewRequest {
                demand_iops: Some(0),
                ..base.clone()
            },
            PreviewRequest {
                size_bytes: 100 * 1024 * GIB,
                ..base.clone()
            },
            PreviewRequest {
                preset: Preset::parse("qemu:bps-total=1000000000000").unwrap(),
                demand_iops: None,
                io_size_bytes: 1,
                ..base.clone()
            },
        ] {
            assert!(preview(&r).is_err(), "{r:?}");
        }
        assert!(preview(&base).is_ok());
    }
}
