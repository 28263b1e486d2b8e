//! The QoS vocabulary shared by the server, the simulator and the CLI.
//!
//! These are plain data types with no behaviour beyond validation, so that a volume's QoS can
//! be stored, sent over the management API and handed to any policy unchanged. Units are in
//! the field names; "unlimited" is `u64::MAX`, never zero, so that a zero can only mean zero.

use crate::cost::CostVector;
use crate::error::QosError;
use serde::{Deserialize, Serialize};

/// Identifier of a volume inside one scheduler instance.
pub type VolumeId = u32;

/// Nanoseconds per second, the unit conversion used everywhere in this crate.
pub const NS_PER_S: u64 = 1_000_000_000;

/// A rate in two dimensions: I/O operations per second and payload bytes per second.
///
/// `u64::MAX` in a field means "no limit in this dimension".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IoRate {
    /// I/O operations per second (counted in the volume's `io_unit_bytes` units).
    pub iops: u64,
    /// Payload bytes per second.
    pub bytes_per_s: u64,
}

impl IoRate {
    /// No limit in either dimension.
    pub const UNLIMITED: IoRate = IoRate {
        iops: u64::MAX,
        bytes_per_s: u64::MAX,
    };

    /// Zero in both dimensions.
    pub const ZERO: IoRate = IoRate {
        iops: 0,
        bytes_per_s: 0,
    };

    /// Builds a rate.
    pub const fn new(iops: u64, bytes_per_s: u64) -> Self {
        IoRate { iops, bytes_per_s }
    }

    /// Component-wise minimum.
    pub fn min(self, other: IoRate) -> IoRate {
        IoRate::new(
            self.iops.min(other.iops),
            self.bytes_per_s.min(other.bytes_per_s),
        )
    }

    /// Component-wise maximum.
    pub fn max(self, other: IoRate) -> IoRate {
        IoRate::new(
            self.iops.max(other.iops),
            self.bytes_per_s.max(other.bytes_per_s),
        )
    }

    /// True when `self <= other` in both dimensions.
    pub fn le(&self, other: &IoRate) -> bool {
        self.iops <= other.iops && self.bytes_per_s <= other.bytes_per_s
    }
}

/// One credit bucket (a gp2/Azure "burst bucket", a QEMU leaky bucket seen from the other side).
///
/// Every admitted I/O spends credits equal to its size in the bucket's unit (I/O units for an
/// IOPS bucket, bytes for a throughput bucket). The bucket refills continuously at
/// `refill_per_s` and never holds more than `capacity`. Once empty, the volume therefore runs at
/// exactly `refill_per_s`: this is how gp2 (refill at the baseline) and QEMU (leak at `avg`)
/// both behave, and why a full bucket drained at rate `r` lasts `capacity / (r - refill)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CreditBucketSpec {
    /// Maximum balance, in the bucket's unit (I/O units or bytes). Must be > 0.
    pub capacity: u64,
    /// Credits earned per second.
    pub refill_per_s: u64,
    /// Whether a newly added volume starts with a full bucket (gp2, Azure, an idle QEMU drive).
    pub start_full: bool,
}

/// The credit buckets of a volume in credit-burst mode; at least one must be present.
///
/// Without a `pool` the buckets are the volume's own, as gp2, Azure and QEMU grant them: every
/// new volume may start with a full burst. That is the "More IOPS for Less" hole (docs/background.md
/// §5.5): an account that replaces small volumes before their credits run out bursts forever.
/// Volumes whose specs name the same `pool` instead share one bucket per dimension, so that
/// credits are granted per account. Semantics of a pool (Credit policy; see docs/qos.md):
/// - it belongs to one policy instance (one scheduler), keyed by the id: a volume served by
///   several workers pools, on each worker, the share of its QoS that worker sees;
/// - its capacity and refill rate are the sums over its current members' buckets in that
///   dimension; every request of a member (baseline or burst) spends from it;
/// - a member's requests within its own baseline meter run whatever the pool's balance (so a
///   member keeps its baseline however its siblings spend); above the baseline a member needs
///   a positive pool balance, as a volume needs one in its own bucket. The refill (>= the sum
///   of the members' baselines) pays the baselines back, so the balance dips below zero by at
///   most a bounded overdraft (the members' baseline meter depths plus one request each);
/// - initial credits are granted once per pool and dimension: when the dimension gets its
///   first member ever, full by that member's capacity if it was added with `start_full`,
///   otherwise empty; later members (replacement volumes) add capacity and refill, never
///   credits. A leaving member shrinks the capacity and the balance is clamped to it; the pool
///   outlives its last member (balance then at most 0), so deleting and recreating every
///   volume does not refill it either;
/// - a live QoS change of a member adjusts capacity and refill without refilling; a volume that
///   joins a pool by a QoS change brings no credits (its own balance is dropped), one that
///   leaves gets its own buckets, empty.
///
/// Only the Credit policy pools; Burst in credit mode (and every other policy) ignores `pool`
/// and gives each volume its own buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CreditSpec {
    /// Bucket counted in I/O units (gp2, Azure IOPS, QEMU `iops-*-max`).
    pub iops: Option<CreditBucketSpec>,
    /// Bucket counted in bytes (Azure MB/s, QEMU `bps-*-max`, st1).
    pub bytes: Option<CreditBucketSpec>,
    /// Shared credit pool (an account) this volume's buckets belong to; `None` = its own.
    #[serde(default)]
    pub pool: Option<u32>,
}

/// How a volume may exceed its baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BurstMode {
    /// Never above the baseline (gp3, io2, a plain QEMU limit without `*-max`).
    #[default]
    None,
    /// Above the baseline, up to the ceiling, while credits last (gp2, Azure credit, QEMU `*-max`).
    Credits(CreditSpec),
    /// Above the baseline, up to the ceiling, whenever the node has spare capacity
    /// (Azure on-demand, Alibaba AutoPL burst).
    OnDemand,
}

/// The QoS a volume was sold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VolumeQos {
    /// Always guaranteed (given the node is not over-provisioned).
    pub baseline: IoRate,
    /// Never exceeded, whatever the burst mode and however idle the node.
    pub ceiling: IoRate,
    /// How the volume may go above `baseline`.
    pub burst: BurstMode,
    /// Share of spare capacity relative to other volumes (>= 1).
    pub weight: u32,
    /// IOPS accounting unit: a request of `len` bytes counts as `ceil(len / io_unit_bytes)` I/Os
    /// (AWS: 256 KiB; QEMU: `iops-size`). Zero means every request counts as one I/O.
    pub io_unit_bytes: u32,
}

impl Default for VolumeQos {
    /// Best effort: nothing guaranteed, no ceiling, runs on spare capacity (on-demand burst),
    /// weight 1. This is what a volume gets when a request arrives for an unknown volume.
    fn default() -> Self {
        VolumeQos {
            baseline: IoRate::ZERO,
            ceiling: IoRate::UNLIMITED,
            burst: BurstMode::OnDemand,
            weight: 1,
            io_unit_bytes: 0,
        }
    }
}

impl VolumeQos {
    /// A volume limited to one fixed rate (baseline = ceiling, no burst).
    pub fn fixed(rate: IoRate) -> Self {
        VolumeQos {
            baseline: rate,
            ceiling: rate,
            burst: BurstMode::None,
            ..VolumeQos::default()
        }
    }

    /// Number of I/O units a request of `len_bytes` counts as (at least one).
    pub fn io_units(&self, len_bytes: u32) -> u64 {
        io_units(self.io_unit_bytes, len_bytes)
    }

    /// The most a volume may ever receive under a policy that honours its burst mode:
    /// the ceiling if it may burst, else the baseline (clamped to the ceiling).
    pub fn burst_ceiling(&self) -> IoRate {
        match self.burst {
            BurstMode::None => self.baseline.min(self.ceiling),
            BurstMode::Credits(_) | BurstMode::OnDemand => self.ceiling,
        }
    }

    /// The share `num / den` of this QoS: what one of several scheduler workers enforces when
    /// it sees that share of the volume's requests (each worker runs its own policy, so the
    /// shares of all workers add up to the volume's QoS).
    ///
    /// Rates and bucket refills and capacities are scaled by `num / den`, rounded down;
    /// `u64::MAX` (unlimited) stays unlimited, a bucket keeps a capacity of at least 1 (a
    /// zero capacity is invalid), and weight, I/O unit, `start_full` and the pool are kept.
    /// `num == den` and `den == 0` return the QoS unchanged; a share above one (`num > den`)
    /// saturates at `u64::MAX - 1` rather than becoming unlimited.
    pub fn scaled(&self, num: u64, den: u64) -> VolumeQos {
        if num == den {
            return *self;
        }
        let rate = |r: IoRate| {
            IoRate::new(
                scale_u64(r.iops, num, den),
                scale_u64(r.bytes_per_s, num, den),
            )
        };
        let bucket = |b: Option<CreditBucketSpec>| {
            b.map(|b| CreditBucketSpec {
                capacity: scale_u64(b.capacity, num, den).max(1),
                refill_per_s: scale_u64(b.refill_per_s, num, den),
                start_full: b.start_full,
            })
        };
        VolumeQos {
            baseline: rate(self.baseline),
            ceiling: rate(self.ceiling),
            burst: match self.burst {
                BurstMode::Credits(c) => BurstMode::Credits(CreditSpec {
                    iops: bucket(c.iops),
                    bytes: bucket(c.bytes),
                    pool: c.pool,
                }),
                other => other,
            },
            weight: self.weight,
            io_unit_bytes: self.io_unit_bytes,
        }
    }

    /// Checks the internal consistency of the QoS.
    pub fn validate(&self) -> Result<(), QosError> {
        if !self.baseline.le(&self.ceiling) {
            return Err(QosError::InvalidQos(format!(
                "baseline {:?} exceeds ceiling {:?}",
                self.baseline, self.ceiling
            )));
        }
        if self.weight == 0 {
            return Err(QosError::InvalidQos("weight must be >= 1".into()));
        }
        if let BurstMode::Credits(spec) = &self.burst {
            if spec.iops.is_none() && spec.bytes.is_none() {
                return Err(QosError::InvalidQos(
                    "credit burst mode needs an IOPS or a bytes bucket".into(),
                ));
            }
            let pairs = [
                (spec.iops, self.baseline.iops, "IOPS"),
                (spec.bytes, self.baseline.bytes_per_s, "bytes"),
            ];
            for (bucket, baseline, what) in pairs {
                let Some(b) = bucket else { continue };
                if b.capacity == 0 {
                    return Err(QosError::InvalidQos(format!(
                        "{what} credit bucket capacity must be > 0"
                    )));
                }
                // An empty bucket delivers exactly its refill rate; below the baseline it
                // would break the baseline guarantee.
                if b.refill_per_s < baseline {
                    return Err(QosError::InvalidQos(format!(
                        "{what} credit refill {} per s is below the baseline {baseline}",
                        b.refill_per_s
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `v × num / den` rounded down, computed exactly in 128 bits; `u64::MAX` (unlimited) and a
/// zero `den` leave `v` unchanged, and a result beyond 64 bits saturates just below unlimited.
fn scale_u64(v: u64, num: u64, den: u64) -> u64 {
    if v == u64::MAX || den == 0 {
        return v;
    }
    let scaled = u128::from(v) * u128::from(num) / u128::from(den);
    u64::try_from(scaled).unwrap_or(u64::MAX).min(u64::MAX - 1)
}

/// Number of I/O units a request of `len_bytes` counts as, given a unit size (0 = one per request).
pub fn io_units(io_unit_bytes: u32, len_bytes: u32) -> u64 {
    if io_unit_bytes == 0 {
        1
    } else {
        u64::from(len_bytes.div_ceil(io_unit_bytes)).max(1)
    }
}

/// What one worker (or one node) can do per second, as a cost vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeCapacity {
    /// Capacity per second in each dimension (`u64::MAX` = not a bottleneck).
    pub per_second: CostVector,
}

impl NodeCapacity {
    /// A capacity that never binds.
    pub const UNLIMITED: NodeCapacity = NodeCapacity {
        per_second: CostVector::MAX,
    };

    /// Builds a capacity.
    pub const fn new(per_second: CostVector) -> Self {
        NodeCapacity { per_second }
    }
}

/// The kind of an I/O request (NBD commands that reach the scheduler).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OpKind {
    /// Read `len_bytes` at `offset_bytes`.
    Read,
    /// Write `len_bytes` at `offset_bytes`.
    Write,
    /// Make previous writes durable.
    Flush,
    /// Discard a range.
    Trim,
    /// Write zeroes over a range without a payload.
    WriteZeroes,
}

impl OpKind {
    /// Whether the request carries a payload from the client.
    pub fn has_ingress_payload(self) -> bool {
        matches!(self, OpKind::Write)
    }

    /// Whether the reply carries a payload to the client.
    pub fn has_egress_payload(self) -> bool {
        matches!(self, OpKind::Read)
    }

    /// Stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Trim => "trim",
            OpKind::WriteZeroes => "write_zeroes",
        }
    }
}

/// One request as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IoRequest {
    /// Unique per request, chosen by the caller.
    pub id: u64,
    /// The volume it belongs to.
    pub volume: VolumeId,
    /// What it does.
    pub op: OpKind,
    /// Byte offset in the volume.
    pub offset_bytes: u64,
    /// Length in bytes (payload size for reads and writes, range for trim/zeroes).
    pub len_bytes: u32,
    /// Estimated cost (from a [`crate::model::CostModel`]).
    pub cost: CostVector,
    /// When the request arrived at the scheduler.
    pub arrival_ns: u64,
}

impl IoRequest {
    /// Payload bytes counted against a volume's bytes/s limits: reads and writes only.
    pub fn payload_bytes(&self) -> u64 {
        match self.op {
            OpKind::Read | OpKind::Write => u64::from(self.len_bytes),
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => 0,
        }
    }
}

/// Why an I/O was allowed to run, reported per I/O so an operator sees who burst on what.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Within the volume's baseline.
    Baseline,
    /// Above the baseline, paid with the volume's own burst credits.
    BurstCredit,
    /// Above the baseline, on capacity other volumes provisioned but did not use.
    BurstSpare,
}

impl Phase {
    /// All phases.
    pub const ALL: [Phase; 3] = [Phase::Baseline, Phase::BurstCredit, Phase::BurstSpare];

    /// Stable name for metrics (`baseline`, `burst_credit`, `burst_spare`).
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Baseline => "baseline",
            Phase::BurstCredit => "burst_credit",
            Phase::BurstSpare => "burst_spare",
        }
    }
}

/// The answer of [`crate::policy::Policy::next`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run this request now.
    Dispatch(IoRequest, Phase),
    /// Nothing may run before this absolute time (ns); call `next` again then, or earlier if a
    /// request is enqueued or completed.
    WaitUntil(u64),
    /// No request is queued.
    Idle,
}

/// What the executor observed for a completed request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Observed {
    /// Time spent executing (front end + backend), nanoseconds.
    pub service_ns: u64,
    /// Time between dispatch and the start of execution (executor queueing), nanoseconds.
    pub queue_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_units_round_up_and_count_at_least_one() {
        assert_eq!(io_units(0, 1 << 20), 1);
        assert_eq!(io_units(256 * 1024, 4096), 1);
        assert_eq!(io_units(256 * 1024, 256 * 1024), 1);
        assert_eq!(io_units(256 * 1024, 256 * 1024 + 1), 2);
        assert_eq!(io_units(256 * 1024, 1024 * 1024), 4);
        assert_eq!(io_units(4096, 0), 1);
    }

    #[test]
    fn validate_rejects_inconsistent_qos() {
        let mut q = VolumeQos::fixed(IoRate::new(100, 1000));
        assert!(q.validate().is_ok());
        q.baseline.iops = 200;
        assert!(q.validate().is_err());
        let mut q = VolumeQos {
            weight: 0,
            ..VolumeQos::default()
        };
        assert!(q.validate().is_err());
        q.weight = 1;
        q.burst = BurstMode::Credits(CreditSpec {
            iops: None,
            bytes: None,
            pool: None,
        });
        assert!(q.validate().is_err());
    }

    #[test]
    fn scaled_takes_a_share_of_every_rate_and_bucket() {
        let q = VolumeQos {
            baseline: IoRate::new(300, 128 << 20),
            ceiling: IoRate::new(3_000, u64::MAX),
            burst: BurstMode::Credits(CreditSpec {
                iops: Some(CreditBucketSpec {
                    capacity: 5_400_000,
                    refill_per_s: 300,
                    start_full: true,
                }),
                bytes: Some(CreditBucketSpec {
                    capacity: 2,
                    refill_per_s: 7,
                    start_full: false,
                }),
                pool: Some(3),
            }),
            weight: 3,
            io_unit_bytes: 256 * 1024,
        };
        let s = q.scaled(1, 3);
        assert_eq!(s.baseline, IoRate::new(100, 44_739_242)); // 134,217,728 / 3, rounded down
        // Unlimited stays unlimited.
        assert_eq!(s.ceiling, IoRate::new(1_000, u64::MAX));
        let BurstMode::Credits(c) = s.burst else {
            panic!("expected credits, got {:?}", s.burst);
        };
        assert_eq!(
            c.iops,
            Some(CreditBucketSpec {
                capacity: 1_800_000,
                refill_per_s: 100,
                start_full: true
            })
        );
        // A capacity that rounds to zero is kept at one; refill rounds down (7 / 3 = 2).
        assert_eq!(
            c.bytes,
            Some(CreditBucketSpec {
                capacity: 1,
                refill_per_s: 2,
                start_full: false
            })
        );
        assert_eq!(
            (c.pool, s.weight, s.io_unit_bytes),
            (Some(3), 3, 256 * 1024)
        );
        // The whole share, and a zero denominator, change nothing.
        assert_eq!(q.scaled(4, 4), q);
        assert_eq!(q.scaled(1, 0), q);
        // Exact in 128 bits: no overflow of rate × num.
        let big = VolumeQos::fixed(IoRate::new(u64::MAX - 1, 1 << 62));
        assert_eq!(
            big.scaled(3, 4).baseline,
            IoRate::new(13_835_058_055_282_163_710, 3 << 60)
        );
        // A share above one saturates below unlimited.
        assert_eq!(big.scaled(8, 1).baseline.iops, u64::MAX - 1);
        // On-demand and no-burst modes are kept as they are.
        assert_eq!(VolumeQos::default().scaled(1, 2).burst, BurstMode::OnDemand);
    }

    #[test]
    fn burst_ceiling_follows_mode() {
        let mut q = VolumeQos {
            baseline: IoRate::new(100, 1000),
            ceiling: IoRate::new(300, 3000),
            burst: BurstMode::None,
            ..VolumeQos::default()
        };
        assert_eq!(q.burst_ceiling(), IoRate::new(100, 1000));
        q.burst = BurstMode::OnDemand;
        assert_eq!(q.burst_ceiling(), IoRate::new(300, 3000));
    }

    #[test]
    fn credit_spec_without_a_pool_parses_as_its_own_buckets() {
        // Specs written before pools existed keep parsing, as unpooled buckets.
        let old =
            r#"{"iops":{"capacity":5400000,"refill_per_s":300,"start_full":true},"bytes":null}"#;
        let spec: CreditSpec = serde_json::from_str(old).unwrap();
        assert_eq!(spec.pool, None);
        assert_eq!(spec.iops.map(|b| b.capacity), Some(5_400_000));
        let pooled =
            r#"{"iops":null,"bytes":{"capacity":9,"refill_per_s":1,"start_full":false},"pool":7}"#;
        let spec: CreditSpec = serde_json::from_str(pooled).unwrap();
        assert_eq!(spec.pool, Some(7));
        let back: CreditSpec =
            serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
        assert_eq!(back, spec);
    }
}
