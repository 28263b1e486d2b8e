//! Presets: the storage classes operators already sell, as [`VolumeQos`] values.
//!
//! Operators and tenants think in "gp2", "P10 with credit bursting" or a libvirt `<iotune>`
//! block, not in token buckets. Each preset turns (class, volume size) into a `VolumeQos` whose
//! behaviour under the Credit policy reproduces the product's published numbers (docs/background.md §5,
//! docs/background.md §7.1). Formulas and the approximations made are listed in `docs/qos.md`.
//!
//! Units: AWS documents MiB/s (2^20 bytes); Azure and Alibaba document MB/s, taken here as
//! 10^6 bytes. Sizes are whole GiB, rounded up.

use crate::error::QosError;
use crate::vocab::{BurstMode, CreditBucketSpec, CreditSpec, IoRate, VolumeQos};
use std::fmt;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;
const MB: u64 = 1_000_000;

/// AWS counts SSD I/O in units of up to 256 KiB.
pub const AWS_IO_UNIT_BYTES: u32 = 256 * 1024;
/// gp2 burst rate, IOPS.
pub const GP2_BURST_IOPS: u64 = 3_000;
/// gp2 bucket: 5.4 M I/O credits (3,000 IOPS for 30 minutes).
pub const GP2_BUCKET_CREDITS: u64 = 5_400_000;
/// Azure credit bursting: a full bucket lasts 30 minutes at the burst rate.
pub const AZURE_BURST_SECONDS: u64 = 1_800;

/// A storage class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Preset {
    /// AWS EBS gp2: 3 IOPS/GiB (100–16,000), burst to 3,000 on a 5.4 M-credit bucket.
    Gp2,
    /// AWS EBS gp3: 3,000 IOPS and 125 MiB/s included, more provisioned; no burst.
    Gp3 {
        /// Provisioned IOPS (3,000–16,000, at most 500 per GiB).
        iops: u64,
        /// Provisioned throughput, MiB/s (125–1,000, at most 0.25 MiB/s per IOPS).
        throughput_mib_s: u64,
    },
    /// AWS EBS io2: provisioned IOPS, no burst.
    Io2 {
        /// Provisioned IOPS (100–64,000, at most 500 per GiB).
        iops: u64,
    },
    /// Azure premium SSD P1–P20 with credit bursting (3,500 IOPS / 170 MB/s for 30 min).
    AzureCredit,
    /// Azure premium SSD P30 and larger with on-demand bursting (30,000 IOPS / 1,000 MB/s).
    AzureOnDemand,
    /// Alibaba ESSD AutoPL: PL1 baseline by size, optional provisioned IOPS, burst on demand.
    AutoPl {
        /// Extra provisioned IOPS (each adds 16 KB/s).
        provisioned_iops: u64,
    },
    /// QEMU throttle group / libvirt `<iotune>` limits.
    Qemu(QemuIotune),
}

/// QEMU `throttling.*` limits (total only; 0 or absent = unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QemuIotune {
    /// `iops-total`: average IOPS.
    pub iops_total: Option<u64>,
    /// `iops-total-max`: burst IOPS.
    pub iops_total_max: Option<u64>,
    /// `iops-total-max-length`: seconds the burst bucket holds at the burst rate (default 1).
    pub iops_total_max_length_s: Option<u64>,
    /// `bps-total`: average bytes/s.
    pub bps_total: Option<u64>,
    /// `bps-total-max`: burst bytes/s.
    pub bps_total_max: Option<u64>,
    /// `bps-total-max-length`: seconds (default 1).
    pub bps_total_max_length_s: Option<u64>,
    /// `iops-size`: requests larger than this count as several operations.
    pub iops_size_bytes: Option<u32>,
}

fn invalid(preset: &str, reason: impl Into<String>) -> QosError {
    QosError::InvalidPreset {
        preset: preset.to_string(),
        reason: reason.into(),
    }
}

fn parse_u64(preset: &str, key: &str, v: &str) -> Result<u64, QosError> {
    v.trim().replace('_', "").parse::<u64>().map_err(|_| {
        invalid(
            preset,
            format!("{key}: {v:?} is not a non-negative integer"),
        )
    })
}

/// Splits `name:k=v,k=v` into the name and normalised key/value pairs.
fn split(text: &str) -> Result<(String, Vec<(String, String)>), QosError> {
    let t = text.trim();
    let (name, rest) = match t.split_once(':') {
        Some((n, r)) => (n, Some(r)),
        None => (t, None),
    };
    let mut pairs = Vec::new();
    if let Some(rest) = rest {
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| invalid(text, format!("{item:?} is not key=value")))?;
            let k = k.trim().to_ascii_lowercase();
            let k = k
                .strip_prefix("throttling.")
                .unwrap_or(&k)
                .replace('_', "-");
            pairs.push((k, v.trim().to_string()));
        }
    }
    Ok((name.trim().to_ascii_lowercase(), pairs))
}

impl Preset {
    /// Parses a preset: `gp2`, `gp3[:iops=N,throughput=MiBps]`, `io2:iops=N`, `azure-credit`,
    /// `azure-ondemand`, `autopl[:provisioned-iops=N]`, or
    /// `qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10` (also `bps-total*`,
    /// `iops-size`, the `throttling.` prefix and libvirt spellings such as
    /// `total_iops_sec_max_length`; `libvirt:` and `iotune:` are accepted as the name).
    pub fn parse(text: &str) -> Result<Preset, QosError> {
        let (name, pairs) = split(text)?;
        let no_options = |p: Preset| {
            if pairs.is_empty() {
                Ok(p)
            } else {
                Err(invalid(text, format!("{name} takes no options")))
            }
        };
        match name.as_str() {
            "gp2" => no_options(Preset::Gp2),
            "azure-credit" | "azure_credit" => no_options(Preset::AzureCredit),
            "azure-ondemand" | "azure-on-demand" | "azure_ondemand" => {
                no_options(Preset::AzureOnDemand)
            }
            "gp3" => {
                let (mut iops, mut tp) = (3_000, 125);
                for (k, v) in &pairs {
                    match k.as_str() {
                        "iops" => iops = parse_u64(text, k, v)?,
                        "throughput" | "throughput-mib-s" | "mibps" => tp = parse_u64(text, k, v)?,
                        _ => {
                            return Err(invalid(
                                text,
                                format!("unknown gp3 option {k:?} (iops, throughput)"),
                            ));
                        }
                    }
                }
                Ok(Preset::Gp3 {
                    iops,
                    throughput_mib_s: tp,
                })
            }
            "io2" | "io1" => {
                let mut iops = None;
                for (k, v) in &pairs {
                    match k.as_str() {
                        "iops" => iops = Some(parse_u64(text, k, v)?),
                        _ => return Err(invalid(text, format!("unknown io2 option {k:?} (iops)"))),
                    }
                }
                let iops = iops.ok_or_else(|| invalid(text, "io2 needs iops=N"))?;
                Ok(Preset::Io2 { iops })
            }
            "autopl" | "essd-autopl" => {
                let mut provisioned_iops = 0;
                for (k, v) in &pairs {
                    match k.as_str() {
                        "provisioned-iops" | "iops" => provisioned_iops = parse_u64(text, k, v)?,
                        _ => {
                            return Err(invalid(
                                text,
                                format!("unknown autopl option {k:?} (provisioned-iops)"),
                            ));
                        }
                    }
                }
                Ok(Preset::AutoPl { provisioned_iops })
            }
            "qemu" | "libvirt" | "iotune" => parse_qemu(text, &pairs).map(Preset::Qemu),
            other => Err(invalid(
                text,
                format!(
                    "unknown preset {other:?} (gp2, gp3, io2, azure-credit, azure-ondemand, autopl, qemu)"
                ),
            )),
        }
    }

    /// The QoS of a volume of `size_bytes` in this class.
    pub fn volume_qos(&self, size_bytes: u64) -> Result<VolumeQos, QosError> {
        let gib = size_bytes.div_ceil(GIB).max(1);
        let name = self.to_string();
        let qos = match self {
            Preset::Gp2 => gp2(&name, gib)?,
            Preset::Gp3 {
                iops,
                throughput_mib_s,
            } => gp3(&name, gib, *iops, *throughput_mib_s)?,
            Preset::Io2 { iops } => io2(&name, gib, *iops)?,
            Preset::AzureCredit => azure_credit(&name, gib)?,
            Preset::AzureOnDemand => azure_ondemand(&name, gib)?,
            Preset::AutoPl { provisioned_iops } => autopl(&name, gib, *provisioned_iops)?,
            Preset::Qemu(q) => qemu(&name, q)?,
        };
        qos.validate()?;
        Ok(qos)
    }
}

/// Convenience: parse `preset` and build the QoS of a volume of `size_bytes`.
pub fn volume_qos(preset: &str, size_bytes: u64) -> Result<VolumeQos, QosError> {
    Preset::parse(preset)?.volume_qos(size_bytes)
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Preset::Gp2 => f.write_str("gp2"),
            Preset::Gp3 {
                iops,
                throughput_mib_s,
            } => write!(f, "gp3:iops={iops},throughput={throughput_mib_s}"),
            Preset::Io2 { iops } => write!(f, "io2:iops={iops}"),
            Preset::AzureCredit => f.write_str("azure-credit"),
            Preset::AzureOnDemand => f.write_str("azure-ondemand"),
            Preset::AutoPl { provisioned_iops } => {
                write!(f, "autopl:provisioned-iops={provisioned_iops}")
            }
            Preset::Qemu(q) => {
                f.write_str("qemu:")?;
                let fields = [
                    ("iops-total", q.iops_total),
                    ("iops-total-max", q.iops_total_max),
                    ("iops-total-max-length", q.iops_total_max_length_s),
                    ("bps-total", q.bps_total),
                    ("bps-total-max", q.bps_total_max),
                    ("bps-total-max-length", q.bps_total_max_length_s),
                    ("iops-size", q.iops_size_bytes.map(u64::from)),
                ];
                let mut first = true;
                for (k, v) in fields {
                    if let Some(v) = v {
                        if !first {
                            f.write_str(",")?;
                        }
                        first = false;
                        write!(f, "{k}={v}")?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// Weight for the sharing policies: proportional to the sold baseline (one per 100 IOPS).
fn weight_for(baseline_iops: u64) -> u32 {
    (baseline_iops / 100).clamp(1, 10_000) as u32
}

fn gp2(name: &str, gib: u64) -> Result<VolumeQos, QosError> {
    if gib > 16 * 1024 {
        return Err(invalid(
            name,
            format!("gp2 volumes are 1 GiB to 16 TiB, not {gib} GiB"),
        ));
    }
    let base_iops = (3 * gib).clamp(100, 16_000);
    // Throughput: 128 MiB/s up to 170 GiB, 250 MiB/s from 334 GiB; between, 250 MiB/s while
    // bursting (approximated as a 250 MiB/s ceiling over a 128 MiB/s baseline).
    let (base_bps, ceil_bps) = if gib <= 170 {
        (128 * MIB, 128 * MIB)
    } else if gib < 334 {
        (128 * MIB, 250 * MIB)
    } else {
        (250 * MIB, 250 * MIB)
    };
    let burst = if base_iops < GP2_BURST_IOPS {
        BurstMode::Credits(CreditSpec {
            iops: Some(CreditBucketSpec {
                capacity: GP2_BUCKET_CREDITS,
                refill_per_s: base_iops,
                start_full: true,
            }),
            bytes: None,
            pool: None,
        })
    } else {
        BurstMode::None
    };
    let ceil_iops = if base_iops < GP2_BURST_IOPS {
        GP2_BURST_IOPS
    } else {
        base_iops
    };
    Ok(VolumeQos {
        baseline: IoRate::new(base_iops, base_bps),
        ceiling: IoRate::new(ceil_iops, ceil_bps),
        burst,
        weight: weight_for(base_iops),
        io_unit_bytes: AWS_IO_UNIT_BYTES,
    })
}

fn gp3(name: &str, gib: u64, iops: u64, tp_mib: u64) -> Result<VolumeQos, QosError> {
    if gib > 16 * 1024 {
        return Err(invalid(
            name,
            format!("gp3 volumes are 1 GiB to 16 TiB, not {gib} GiB"),
        ));
    }
    if !(3_000..=16_000).contains(&iops) {
        return Err(invalid(
            name,
            format!("gp3 iops must be 3000..=16000, not {iops}"),
        ));
    }
    if iops > 3_000 && iops > 500 * gib {
        return Err(invalid(
            name,
            format!(
                "gp3 allows at most 500 IOPS per GiB ({} for {gib} GiB)",
                500 * gib
            ),
        ));
    }
    if !(125..=1_000).contains(&tp_mib) {
        return Err(invalid(
            name,
            format!("gp3 throughput must be 125..=1000 MiB/s, not {tp_mib}"),
        ));
    }
    if tp_mib > 125 && tp_mib * 4 > iops {
        return Err(invalid(
            name,
            format!(
                "gp3 allows at most 0.25 MiB/s per IOPS ({} MiB/s for {iops} IOPS)",
                iops / 4
            ),
        ));
    }
    Ok(VolumeQos {
        weight: weight_for(iops),
        io_unit_bytes: AWS_IO_UNIT_BYTES,
        ..VolumeQos::fixed(IoRate::new(iops, tp_mib * MIB))
    })
}

fn io2(name: &str, gib: u64, iops: u64) -> Result<VolumeQos, QosError> {
    if !(4..=16 * 1024).contains(&gib) {
        return Err(invalid(
            name,
            format!("io2 volumes are 4 GiB to 16 TiB, not {gib} GiB"),
        ));
    }
    if !(100..=64_000).contains(&iops) {
        return Err(invalid(
            name,
            format!("io2 iops must be 100..=64000, not {iops}"),
        ));
    }
    if iops > 500 * gib {
        return Err(invalid(
            name,
            format!(
                "io2 allows at most 500 IOPS per GiB ({} for {gib} GiB)",
                500 * gib
            ),
        ));
    }
    // Up to 32,000 IOPS: 256 KiB I/O unit and 500 MiB/s; above: 16 KiB unit and 1,000 MiB/s.
    let (unit, bps) = if iops <= 32_000 {
        (AWS_IO_UNIT_BYTES, 500 * MIB)
    } else {
        (16 * 1024, 1_000 * MIB)
    };
    Ok(VolumeQos {
        weight: weight_for(iops),
        io_unit_bytes: unit,
        ..VolumeQos::fixed(IoRate::new(iops, bps))
    })
}

/// Azure premium SSD tiers: (max size GiB, name, provisioned IOPS, provisioned MB/s).
const AZURE_TIERS: [(u64, &str, u64, u64); 15] = [
    (4, "P1", 120, 25),
    (8, "P2", 120, 25),
    (16, "P3", 120, 25),
    (32, "P4", 120, 25),
    (64, "P6", 240, 50),
    (128, "P10", 500, 100),
    (256, "P15", 1_100, 125),
    (512, "P20", 2_300, 150),
    (1_024, "P30", 5_000, 200),
    (2_048, "P40", 7_500, 250),
    (4_096, "P50", 7_500, 250),
    (8_192, "P60", 16_000, 500),
    (16_384, "P70", 18_000, 750),
    (32_767, "P80", 20_000, 900),
    (u64::MAX, "", 0, 0),
];

fn azure_tier(name: &str, gib: u64) -> Result<(&'static str, u64, u64), QosError> {
    AZURE_TIERS
        .iter()
        .find(|t| gib <= t.0 && !t.1.is_empty())
        .map(|t| (t.1, t.2, t.3))
        .ok_or_else(|| {
            invalid(
                name,
                format!("Azure premium SSDs go up to 32,767 GiB, not {gib} GiB"),
            )
        })
}

fn azure_credit(name: &str, gib: u64) -> Result<VolumeQos, QosError> {
    let (tier, iops, mbps) = azure_tier(name, gib)?;
    if gib > 512 {
        return Err(invalid(
            name,
            format!(
                "credit bursting applies to P1-P20 (up to 512 GiB); {gib} GiB is {tier}, use azure-ondemand"
            ),
        ));
    }
    let (burst_iops, burst_bps) = (3_500, 170 * MB);
    let bucket = |burst: u64, base: u64| CreditBucketSpec {
        capacity: (burst - base) * AZURE_BURST_SECONDS,
        refill_per_s: base,
        start_full: true,
    };
    Ok(VolumeQos {
        baseline: IoRate::new(iops, mbps * MB),
        ceiling: IoRate::new(burst_iops, burst_bps),
        burst: BurstMode::Credits(CreditSpec {
            iops: Some(bucket(burst_iops, iops)),
            bytes: Some(bucket(burst_bps, mbps * MB)),
            pool: None,
        }),
        weight: weight_for(iops),
        io_unit_bytes: AWS_IO_UNIT_BYTES,
    })
}

fn azure_ondemand(name: &str, gib: u64) -> Result<VolumeQos, QosError> {
    let (tier, iops, mbps) = azure_tier(name, gib)?;
    if gib <= 512 {
        return Err(invalid(
            name,
            format!(
                "on-demand bursting applies to P30 and larger (over 512 GiB); {gib} GiB is {tier}, use azure-credit"
            ),
        ));
    }
    Ok(VolumeQos {
        baseline: IoRate::new(iops, mbps * MB),
        ceiling: IoRate::new(iops.max(30_000), (mbps * MB).max(1_000 * MB)),
        burst: BurstMode::OnDemand,
        weight: weight_for(iops),
        io_unit_bytes: AWS_IO_UNIT_BYTES,
    })
}

fn autopl(name: &str, gib: u64, provisioned_iops: u64) -> Result<VolumeQos, QosError> {
    if !(40..=32_768).contains(&gib) {
        return Err(invalid(
            name,
            format!("ESSD AutoPL volumes are 40 to 32,768 GiB, not {gib} GiB"),
        ));
    }
    let base_iops = (1_800 + 50 * gib)
        .min(50_000)
        .saturating_add(provisioned_iops);
    let base_bps =
        ((120 * MB + gib * MB / 2).min(350 * MB)).saturating_add(provisioned_iops * 16 * 1_000);
    let ceil_iops = (1_000 * gib).min(1_000_000).max(base_iops);
    let ceil_bps = (4_096 * MB).max(base_bps);
    Ok(VolumeQos {
        baseline: IoRate::new(base_iops, base_bps),
        ceiling: IoRate::new(ceil_iops, ceil_bps),
        burst: BurstMode::OnDemand,
        weight: weight_for(base_iops),
        io_unit_bytes: 16 * 1024,
    })
}

fn parse_qemu(text: &str, pairs: &[(String, String)]) -> Result<QemuIotune, QosError> {
    let mut q = QemuIotune::default();
    for (k, v) in pairs {
        let slot: &mut Option<u64> = match k.as_str() {
            "iops-total" | "total-iops-sec" => &mut q.iops_total,
            "iops-total-max" | "total-iops-sec-max" => &mut q.iops_total_max,
            "iops-total-max-length" | "total-iops-sec-max-length" => &mut q.iops_total_max_length_s,
            "bps-total" | "total-bytes-sec" => &mut q.bps_total,
            "bps-total-max" | "total-bytes-sec-max" => &mut q.bps_total_max,
            "bps-total-max-length" | "total-bytes-sec-max-length" => &mut q.bps_total_max_length_s,
            "iops-size" | "size-iops-sec" => {
                let n = parse_u64(text, k, v)?;
                q.iops_size_bytes = Some(
                    u32::try_from(n)
                        .map_err(|_| invalid(text, format!("iops-size {n} is too large")))?,
                );
                continue;
            }
            key if key.contains("read") || key.contains("write") => {
                return Err(invalid(
                    text,
                    format!(
                        "{key}: per-direction (read/write) limits are not supported; use the total limits"
                    ),
                ));
            }
            key => {
                return Err(invalid(
                    text,
                    format!("unknown QEMU/libvirt throttle option {key:?}"),
                ));
            }
        };
        *slot = Some(parse_u64(text, k, v)?);
    }
    // 0 means "unlimited" in QEMU.
    for f in [
        &mut q.iops_total,
        &mut q.iops_total_max,
        &mut q.bps_total,
        &mut q.bps_total_max,
    ] {
        if *f == Some(0) {
            *f = None;
        }
    }
    if q.iops_size_bytes == Some(0) {
        q.iops_size_bytes = None;
    }
    check_qemu_pair(
        text,
        "iops-total",
        q.iops_total,
        q.iops_total_max,
        q.iops_total_max_length_s,
    )?;
    check_qemu_pair(
        text,
        "bps-total",
        q.bps_total,
        q.bps_total_max,
        q.bps_total_max_length_s,
    )?;
    if q.iops_total.is_none() && q.bps_total.is_none() {
        return Err(invalid(text, "a QEMU preset needs iops-total or bps-total"));
    }
    if q.iops_size_bytes.is_some() && q.iops_total.is_none() {
        return Err(invalid(text, "iops-size needs an iops limit"));
    }
    Ok(q)
}

fn check_qemu_pair(
    text: &str,
    what: &str,
    avg: Option<u64>,
    max: Option<u64>,
    len: Option<u64>,
) -> Result<(), QosError> {
    if max.is_some() && avg.is_none() {
        return Err(invalid(text, format!("{what}-max needs {what}")));
    }
    if let (Some(a), Some(m)) = (avg, max)
        && m < a
    {
        return Err(invalid(
            text,
            format!("{what}-max ({m}) must be >= {what} ({a})"),
        ));
    }
    if let Some(l) = len {
        if max.is_none() {
            return Err(invalid(text, format!("{what}-max-length needs {what}-max")));
        }
        if l == 0 {
            return Err(invalid(text, format!("{what}-max-length must be >= 1 s")));
        }
    }
    Ok(())
}

fn qemu(name: &str, q: &QemuIotune) -> Result<VolumeQos, QosError> {
    // QEMU's leaky bucket seen as credits: the level may rise to max × length and leaks at avg,
    // i.e. a bucket of max × length credits refilled at avg, drained by every request. A full
    // burst lasts max × length / (max − avg) seconds. QEMU's extra instant allowance of max/10
    // (its 100 ms "burst_level" bucket) is not modelled: our limiters are one request deep.
    let bucket = |avg: Option<u64>,
                  max: Option<u64>,
                  len: Option<u64>|
     -> Result<Option<CreditBucketSpec>, QosError> {
        match (avg, max) {
            (Some(a), Some(m)) if m > a => {
                let capacity = m
                    .checked_mul(len.unwrap_or(1))
                    .ok_or_else(|| invalid(name, "max × max-length overflows"))?;
                Ok(Some(CreditBucketSpec {
                    capacity,
                    refill_per_s: a,
                    start_full: true,
                }))
            }
            _ => Ok(None),
        }
    };
    let iops_bucket = bucket(q.iops_total, q.iops_total_max, q.iops_total_max_length_s)?;
    let bps_bucket = bucket(q.bps_total, q.bps_total_max, q.bps_total_max_length_s)?;
    let baseline = IoRate::new(
        q.iops_total.unwrap_or(u64::MAX),
        q.bps_total.unwrap_or(u64::MAX),
    );
    let ceiling = IoRate::new(
        q.iops_total_max.or(q.iops_total).unwrap_or(u64::MAX),
        q.bps_total_max.or(q.bps_total).unwrap_or(u64::MAX),
    );
    let burst = if iops_bucket.is_some() || bps_bucket.is_some() {
        BurstMode::Credits(CreditSpec {
            iops: iops_bucket,
            bytes: bps_bucket,
            pool: None,
        })
    } else {
        BurstMode::None
    };
    Ok(VolumeQos {
        baseline,
        ceiling,
        burst,
        weight: weight_for(q.iops_total.unwrap_or(0)),
        io_unit_bytes: q.iops_size_bytes.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credits(q: &VolumeQos) -> CreditSpec {
        match q.burst {
            BurstMode::Credits(c) => c,
            other => panic!("expected credits, got {other:?}"),
        }
    }

    #[test]
    fn gp2_follows_the_published_table() {
        let q = volume_qos("gp2", 100 * GIB).unwrap();
        assert_eq!(q.baseline.iops, 300);
        assert_eq!(q.ceiling.iops, 3_000);
        assert_eq!(q.io_unit_bytes, 256 * 1024);
        let b = credits(&q).iops.unwrap();
        assert_eq!(
            (b.capacity, b.refill_per_s, b.start_full),
            (5_400_000, 300, true)
        );
        // Burst duration = 5.4 M / (3,000 − baseline); refill time = 5.4 M / baseline.
        for (gib, burst_s, refill_s) in [
            (100, 2_000, 18_000),
            (250, 2_400, 7_200),
            (500, 3_600, 3_600),
            (750, 7_200, 2_400),
        ] {
            let q = volume_qos("gp2", gib * GIB).unwrap();
            let b = credits(&q).iops.unwrap();
            assert_eq!(
                b.capacity / (q.ceiling.iops - b.refill_per_s),
                burst_s,
                "{gib} GiB"
            );
            assert_eq!(b.capacity / b.refill_per_s, refill_s, "{gib} GiB");
        }
        // Floor and ceiling of the baseline; no burst from 1,000 GiB.
        assert_eq!(volume_qos("gp2", GIB).unwrap().baseline.iops, 100);
        let big = volume_qos("gp2", 6_000 * GIB).unwrap();
        assert_eq!((big.baseline.iops, big.burst), (16_000, BurstMode::None));
        assert_eq!(
            volume_qos("gp2", 1_000 * GIB).unwrap().burst,
            BurstMode::None
        );
        // Throughput caps.
        assert_eq!(
            volume_qos("gp2", 170 * GIB).unwrap().ceiling.bytes_per_s,
            128 * MIB
        );
        assert_eq!(
            volume_qos("gp2", 200 * GIB).unwrap().ceiling.bytes_per_s,
            250 * MIB
        );
        assert_eq!(
            volume_qos("gp2", 334 * GIB).unwrap().baseline.bytes_per_s,
            250 * MIB
        );
        assert!(volume_qos("gp2", 17 * 1024 * GIB).is_err());
    }

    #[test]
    fn gp3_and_io2_are_fixed_and_validated() {
        let q = volume_qos("gp3", 10 * GIB).unwrap();
        assert_eq!(
            q,
            VolumeQos {
                weight: 30,
                io_unit_bytes: 256 * 1024,
                ..VolumeQos::fixed(IoRate::new(3_000, 125 * MIB))
            }
        );
        let q = volume_qos("gp3:iops=6000,throughput=500", 100 * GIB).unwrap();
        assert_eq!(q.baseline, IoRate::new(6_000, 500 * MIB));
        assert!(
            volume_qos("gp3:iops=6000", 10 * GIB).is_err(),
            "500 IOPS/GiB"
        );
        assert!(
            volume_qos("gp3:iops=3000,throughput=1000", 100 * GIB).is_err(),
            "0.25 MiB/s per IOPS"
        );
        let q = volume_qos("io2:iops=40000", 100 * GIB).unwrap();
        assert_eq!(
            (q.ceiling, q.io_unit_bytes),
            (IoRate::new(40_000, 1_000 * MIB), 16 * 1024)
        );
        assert!(volume_qos("io2", 100 * GIB).is_err());
        assert!(volume_qos("io2:iops=100000", 1_000 * GIB).is_err());
    }

    #[test]
    fn azure_credit_bucket_lasts_thirty_minutes_at_burst() {
        let q = volume_qos("azure-credit", 128 * GIB).unwrap(); // P10
        assert_eq!(q.baseline, IoRate::new(500, 100 * MB));
        assert_eq!(q.ceiling, IoRate::new(3_500, 170 * MB));
        let c = credits(&q);
        let i = c.iops.unwrap();
        assert_eq!(i.capacity / (q.ceiling.iops - i.refill_per_s), 1_800);
        let b = c.bytes.unwrap();
        assert_eq!(b.capacity / (q.ceiling.bytes_per_s - b.refill_per_s), 1_800);
        assert!(volume_qos("azure-credit", 1_024 * GIB).is_err());
        let od = volume_qos("azure-ondemand", 1_024 * GIB).unwrap(); // P30
        assert_eq!(
            (od.baseline, od.ceiling, od.burst),
            (
                IoRate::new(5_000, 200 * MB),
                IoRate::new(30_000, 1_000 * MB),
                BurstMode::OnDemand
            )
        );
        assert!(volume_qos("azure-ondemand", 100 * GIB).is_err());
    }

    #[test]
    fn autopl_baseline_formula() {
        let q = volume_qos("autopl", 100 * GIB).unwrap();
        assert_eq!(q.baseline, IoRate::new(1_800 + 5_000, 170 * MB));
        assert_eq!(q.ceiling, IoRate::new(100_000, 4_096 * MB));
        let big = volume_qos("autopl:provisioned-iops=1000", 2_000 * GIB).unwrap();
        assert_eq!(big.baseline, IoRate::new(51_000, 350 * MB + 16_000_000));
        assert_eq!(big.ceiling.iops, 1_000_000);
        assert!(volume_qos("autopl", 20 * GIB).is_err());
    }

    #[test]
    fn qemu_and_libvirt_spellings_agree() {
        let a = Preset::parse("qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10")
            .unwrap();
        let b = Preset::parse(
            "libvirt:total_iops_sec=1000,total_iops_sec_max=5000,total_iops_sec_max_length=10",
        )
        .unwrap();
        let c = Preset::parse("qemu:throttling.iops-total=1000,throttling.iops-total-max=5000,throttling.iops-total-max-length=10").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_eq!(Preset::parse(&a.to_string()).unwrap(), a);
        let q = a.volume_qos(GIB).unwrap();
        assert_eq!((q.baseline.iops, q.ceiling.iops), (1_000, 5_000));
        let i = credits(&q).iops.unwrap();
        assert_eq!((i.capacity, i.refill_per_s), (50_000, 1_000));
        // Burst duration max × length / (max − avg) = 12.5 s.
        assert_eq!(i.capacity * 10 / (q.ceiling.iops - i.refill_per_s), 125);
        assert_eq!(
            (q.baseline.bytes_per_s, q.ceiling.bytes_per_s),
            (u64::MAX, u64::MAX)
        );
    }

    #[test]
    fn qemu_bps_and_validation() {
        let q = volume_qos(
            "qemu:bps-total=10000000,bps-total-max=50000000,iops-total=100,iops-size=4096",
            GIB,
        )
        .unwrap();
        assert_eq!(q.io_unit_bytes, 4096);
        let c = credits(&q);
        assert!(c.iops.is_none());
        assert_eq!(c.bytes.unwrap().capacity, 50_000_000);
        assert_eq!(q.ceiling.iops, 100);
        for bad in [
            "qemu:iops-total-max=5000",
            "qemu:iops-total=5000,iops-total-max=1000",
            "qemu:iops-total=1000,iops-total-max-length=10",
            "qemu:iops-total=1000,iops-total-max=2000,iops-total-max-length=0",
            "qemu:iops-read=1000",
            "libvirt:read_iops_sec=1000",
            "qemu:bps-total=1000,iops-size=4096",
            "qemu:",
            "qemu:iops-total=abc",
            "qemu:iops-total",
            "nope",
            "gp2:iops=3",
        ] {
            assert!(Preset::parse(bad).is_err(), "{bad} should be rejected");
        }
        // 0 means unlimited, as in QEMU.
        let q = volume_qos("qemu:iops-total=0,bps-total=1000", GIB).unwrap();
        assert_eq!(q.baseline.iops, u64::MAX);
    }
}
