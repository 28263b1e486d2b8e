//! A volume's QoS as the node stores, shows and persists it.
//!
//! The store keeps an opaque JSON string per volume (it does not depend on the QoS crate);
//! this module owns its format: the operator's [`QosSpec`] (preset and refinements, so a
//! resize can re-derive a size-dependent class such as gp2) and the [`VolumeQos`] it resolved
//! to. It also owns the credit balance records that let a restart keep every volume's burst
//! credits, and the bound that makes a `kill -9` never hand out credit a volume did not have.
//!
//! # Credit balances across restarts
//!
//! Balances live in the policies (per scheduler worker); the node sums them per volume.
//! * A clean shutdown saves the exact balances.
//! * While running, a saver writes every `credit_save_period_ms` (1 s by default) a
//!   *pessimistic* balance: the balance now minus what the volume could spend, net of its
//!   refill, at its ceiling during [`SAVE_MARGIN_PERIODS`] periods. The first such save happens
//!   at start-up, before any I/O is accepted, so the exact balance of the clean shutdown is
//!   never what a crash finds.
//! * Restarts restore the saved balance (clamped to the bucket). Downtime earns no credit.
//!
//! The bound: after a `kill -9` a volume comes back with at most the balance it had when it
//! was killed, provided the saver's last write was less than `SAVE_MARGIN_PERIODS` periods
//! before the kill (it writes every period; a write that starts late is logged as a warning).
//! A volume with credits and no finite ceiling in a bucket's dimension could spend without
//! bound, so that bucket is saved as empty.

use std::time::{SystemTime, UNIX_EPOCH};

use headroom_qos::{BurstMode, IoRate, QosSpec, VolumeQos};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::scheduler::PhaseStats;

/// Periods of spending at the ceiling a running save subtracts (see the module doc).
pub const SAVE_MARGIN_PERIODS: u64 = 3;

/// The per-volume QoS record kept in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredQos {
    /// What the operator asked for.
    pub spec: QosSpec,
    /// What it resolved to for the volume's size.
    pub qos: VolumeQos,
}

impl StoredQos {
    /// Resolves `spec` for a volume of `size_bytes`.
    pub fn resolve(spec: QosSpec, size_bytes: u64) -> Result<StoredQos, headroom_qos::QosError> {
        let qos = spec.resolve(size_bytes)?;
        Ok(StoredQos { spec, qos })
    }

    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialization cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn from_json(text: &str) -> Option<StoredQos> {
        serde_json::from_str(text).ok()
    }
}

/// The QoS a volume runs with: its stored QoS, or none (unlimited, best effort) when it has
/// none or the record cannot be read (logged).
pub fn effective_qos(stored: Option<&str>, _size_bytes: u64) -> VolumeQos {
    match stored {
        None => VolumeQos::default(),
        Some(text) => match StoredQos::from_json(text) {
            Some(record) => record.qos,
            None => {
                tracing::error!("unreadable QoS record {text:?}: serving the volume unlimited");
                VolumeQos::default()
            }
        },
    }
}

/// A saved credit balance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditRecord {
    pub iops_credits: Option<u64>,
    pub bytes_credits: Option<u64>,
    /// Saved by a clean shutdown (exact) rather than while running (pessimistic).
    pub clean: bool,
    pub saved_unix_ms: u64,
}

impl CreditRecord {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<CreditRecord> {
        serde_json::from_slice(bytes).ok()
    }

    /// The record to save for `balances` now. Running saves subtract what the volume could
    /// spend in `margin_ms` (see the module doc).
    pub fn for_save(
        qos: &VolumeQos,
        balances: (Option<u64>, Option<u64>),
        clean: bool,
        margin_ms: u64,
    ) -> CreditRecord {
        let (iops, bytes) = balances;
        let (iops, bytes) = if clean {
            (iops, bytes)
        } else {
            let refill = match &qos.burst {
                BurstMode::Credits(spec) => (
                    spec.iops.map_or(0, |b| b.refill_per_s),
                    spec.bytes.map_or(0, |b| b.refill_per_s),
                ),
                _ => (0, 0),
            };
            (
                iops.map(|b| pessimistic(b, qos.ceiling.iops, refill.0, margin_ms)),
                bytes.map(|b| pessimistic(b, qos.ceiling.bytes_per_s, refill.1, margin_ms)),
            )
        };
        CreditRecord {
            iops_credits: iops,
            bytes_credits: bytes,
            clean,
            saved_unix_ms: unix_ms(),
        }
    }
}

/// `balance` minus the most it can fall in `margin_ms` spending at `ceiling_per_s` while
/// refilling at `refill_per_s`.
fn pessimistic(balance: u64, ceiling_per_s: u64, refill_per_s: u64, margin_ms: u64) -> u64 {
    if ceiling_per_s == u64::MAX {
        return 0;
    }
    let net_per_s = ceiling_per_s.saturating_sub(refill_per_s);
    let drop = u128::from(net_per_s) * u128::from(margin_ms) / 1000;
    balance.saturating_sub(u64::try_from(drop).unwrap_or(u64::MAX))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A rate for people and JSON: `null` means unlimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RateView {
    pub iops: Option<u64>,
    pub bytes_per_s: Option<u64>,
}

impl From<IoRate> for RateView {
    fn from(rate: IoRate) -> Self {
        let finite = |v: u64| (v != u64::MAX).then_some(v);
        RateView {
            iops: finite(rate.iops),
            bytes_per_s: finite(rate.bytes_per_s),
        }
    }
}

/// One credit bucket as shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BucketView {
    pub capacity: u64,
    pub refill_per_s: u64,
}

/// A volume's QoS as `volume show` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QosView {
    /// What the operator asked for (preset and refinements).
    #[schema(value_type = QosSpecSchema)]
    pub spec: QosSpec,
    pub baseline: RateView,
    pub ceiling: RateView,
    /// `none`, `credits` or `on-demand`.
    pub burst: String,
    pub weight: u32,
    /// Requests larger than this count as several I/Os (0: every request is one).
    pub io_unit_bytes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_bucket: Option<BucketView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_bucket: Option<BucketView>,
}

impl QosView {
    pub fn new(spec: QosSpec, qos: &VolumeQos) -> QosView {
        let (burst, iops_bucket, bytes_bucket) = match &qos.burst {
            BurstMode::None => ("none", None, None),
            BurstMode::OnDemand => ("on-demand", None, None),
            BurstMode::Credits(c) => {
                let view = |b: headroom_qos::CreditBucketSpec| BucketView {
                    capacity: b.capacity,
                    refill_per_s: b.refill_per_s,
                };
                ("credits", c.iops.map(view), c.bytes.map(view))
            }
        };
        QosView {
            spec,
            baseline: qos.baseline.into(),
            ceiling: qos.ceiling.into(),
            burst: burst.to_string(),
            weight: qos.weight,
            io_unit_bytes: qos.io_unit_bytes,
            iops_bucket,
            bytes_bucket,
        }
    }
}

/// Whole credits per bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreditsView {
    pub iops: Option<u64>,
    pub bytes: Option<u64>,
}

/// Completed I/Os of one phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PhaseView {
    pub ios: u64,
    pub bytes: u64,
    /// Time from arrival to completion, summed over the phase's I/Os.
    pub time_ns: u64,
}

/// I/Os the policy held back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ThrottledView {
    pub ios: u64,
    /// Time they waited for the policy, summed.
    pub time_ns: u64,
}

/// Per-phase counters of a volume since the node started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PhasesView {
    pub baseline: PhaseView,
    pub burst_credit: PhaseView,
    pub burst_spare: PhaseView,
    pub throttled: ThrottledView,
}

impl From<PhaseStats> for PhasesView {
    fn from(s: PhaseStats) -> Self {
        let phase = |i: usize| PhaseView {
            ios: s.ios[i],
            bytes: s.bytes[i],
            time_ns: s.latency_ns[i],
        };
        PhasesView {
            baseline: phase(0),
            burst_credit: phase(1),
            burst_spare: phase(2),
            throttled: ThrottledView {
                ios: s.throttled_ios,
                time_ns: s.throttled_ns,
            },
        }
    }
}

/// A volume's QoS as an operator writes it (`headroom_qos::QosSpec`; documented with the stored
/// record so the policy crate needs no OpenAPI dependency).
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[schema(as = QosSpec)]
pub struct QosSpecSchema {
    /// A preset: gp2, gp3[:iops=N,throughput=MiBps], io2:iops=N, azure-credit,
    /// azure-ondemand, autopl[:provisioned-iops=N], or qemu:iops-total=...,...
    pub preset: Option<String>,
    /// Guaranteed IOPS (0 = nothing guaranteed).
    pub baseline_iops: Option<u64>,
    /// Guaranteed MB/s, decimal (10^6 bytes per second).
    pub baseline_mbps: Option<u64>,
    /// Most IOPS ever allowed (> 0).
    pub ceiling_iops: Option<u64>,
    /// Most MB/s ever allowed, decimal (> 0).
    pub ceiling_mbps: Option<u64>,
    /// How the volume may exceed its baseline.
    pub burst: Option<BurstSchema>,
    /// Share of spare capacity relative to other volumes (1-10000).
    pub weight: Option<u32>,
}

/// How a volume may exceed its baseline.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[schema(as = BurstKind)]
#[serde(rename_all = "kebab-case")]
pub enum BurstSchema {
    /// Never above the baseline.
    None,
    /// Up to the ceiling while credits last.
    Credits,
    /// Up to the ceiling whenever the node has spare capacity.
    OnDemand,
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_qos::{CreditBucketSpec, CreditSpec};

    fn credit_qos(ceiling_iops: u64, refill: u64) -> VolumeQos {
        VolumeQos {
            baseline: IoRate::new(refill, u64::MAX),
            ceiling: IoRate::new(ceiling_iops, u64::MAX),
            burst: BurstMode::Credits(CreditSpec {
                iops: Some(CreditBucketSpec {
                    capacity: 50_000,
                    refill_per_s: refill,
                    start_full: true,
                }),
                bytes: None,
                pool: None,
            }),
            weight: 1,
            io_unit_bytes: 0,
        }
    }

    #[test]
    fn running_saves_subtract_the_most_the_volume_can_spend_in_the_margin() {
        let qos = credit_qos(5_000, 1_000);
        // 3 s at a net 4,000 credits/s.
        let saved = CreditRecord::for_save(&qos, (Some(30_000), None), false, 3_000);
        assert_eq!(saved.iops_credits, Some(18_000));
        assert!(!saved.clean);
        let low = CreditRecord::for_save(&qos, (Some(5_000), None), false, 3_000);
        assert_eq!(low.iops_credits, Some(0));
        let clean = CreditRecord::for_save(&qos, (Some(30_000), None), true, 3_000);
        assert_eq!(clean.iops_credits, Some(30_000));
    }

    #[test]
    fn a_bucket_without_a_finite_ceiling_is_saved_empty_while_running() {
        let qos = credit_qos(u64::MAX, 1_000);
        let saved = CreditRecord::for_save(&qos, (Some(30_000), None), false, 3_000);
        assert_eq!(saved.iops_credits, Some(0));
    }

    #[test]
    fn records_round_trip() {
        let record = CreditRecord {
            iops_credits: Some(7),
            bytes_credits: None,
            clean: true,
            saved_unix_ms: 1,
        };
        assert_eq!(CreditRecord::from_bytes(&record.to_bytes()), Some(record));
        assert_eq!(CreditRecord::from_bytes(b"not json"), None);
    }

    #[test]
    fn volumes_without_a_record_run_unlimited() {
        assert_eq!(effective_qos(None, 1 << 30), VolumeQos::default());
        assert_eq!(
            effective_qos(Some("garbage"), 1 << 30),
            VolumeQos::default()
        );
        let spec = QosSpec {
            baseline_iops: Some(100),
            ..QosSpec::default()
        };
        let stored = StoredQos::resolve(spec, 1 << 30).expect("valid spec");
        assert_eq!(effective_qos(Some(&stored.to_json()), 1 << 30), stored.qos);
    }
}
