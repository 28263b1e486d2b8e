//! The `serve` configuration: a TOML file, the command line over it, and the file
//! `headroom calibrate` wrote under it.
//!
//! A [`ConfigFile`] is one layer of settings, every key optional. Layers are merged highest
//! first, key by key ([`ConfigFile::over`]):
//!
//! 1. command-line flags (`serve --io-threads 4`, `--policy off`, ...);
//! 2. `--config FILE`;
//! 3. `DATA_DIR/calibration.toml`, when the data directory holds one;
//! 4. built-in defaults ([`resolve`] applies them: those of [`NodeConfig::new`],
//!    [`Limits::default`] and [`QosConfig::default`]).
//!
//! A few keys are merged as a unit: `storage.emulated` (a device is described whole), each of
//! `qos.cost.cpu.read|write|other`, and `qos.cost.device`. A layer that sets `qos.cost.device`
//! also decides `qos.capacity.device_units_per_s` (absent there: unlimited), because device
//! units mean device-ns for a linear model and milli-VOPs for a VOP curve; a lower layer's
//! capacity in the other unit would be wrong.
//!
//! Every table rejects unknown keys. Sizes are bytes or strings such as `"64KiB"`, `"4GiB"`,
//! `"2GB"` (the CLI's size syntax). Values out of range fail with the key, the value and
//! what is allowed: `qos.workers = 0: must be between 1 and 64`. docs/operations.md
//! ("Configuration file") describes every key.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use headroom_node::arbitration::ArbitrationConfig;
use headroom_node::config::{DispatchMode, PolicyChoice, QosConfig};
use headroom_node::config::{LimitRule, LimitsError};
use headroom_node::emulated::{EmulatedDeviceSpec, EmulatedError};
use headroom_node::metrics::{MAX_MAX_VOLUME_SERIES, MetricsConfig};
use headroom_node::scheduler::config as qos_setting;
use headroom_node::setting;
use headroom_node::{Limits, NodeConfig, StoreBackend, TlsConfig};
use headroom_qos::model::{CpuModel, DeviceModel, IoCostModel, LinearCpu, VopCurve};
use headroom_qos::routing::ReadRouting;
use headroom_qos::{CostModel, CostVector, NS_PER_S, NodeCapacity, PolicyParams};
use headroom_store::{FaultConfig, FaultRule, FaultScope};
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::size::{format_size, parse_size};

/// The file `headroom calibrate` writes in the data directory, loaded under `--config`.
pub const CALIBRATION_FILE: &str = "calibration.toml";
/// Data directory when neither a flag nor a file names one.
pub const DEFAULT_DATA_DIR: &str = "./headroom-data";
/// Device files in a new data directory by default.
pub const DEFAULT_DEVICES: u32 = 2;
/// Capacity of each device file in a new data directory by default (sparse).
pub const DEFAULT_DEVICE_SIZE: u64 = 64 << 30;
/// Smallest request-size limit: the block size we advertise as preferred.
const MIN_REQUEST_BYTES: u64 = headroom_nbd::PREFERRED_BLOCK_BYTES as u64;
/// Largest request-size limit the NBD layer accepts.
const MAX_REQUEST_BYTES: u64 = headroom_nbd::MAX_PAYLOAD_BYTES as u64;

/// A value out of range: names the key, the value and what is allowed.
/// Highest background rate accepted (the scrub's, like `PUT /v1/scrub`'s): 10 GiB/s.
const MAX_BACKGROUND_RATE_BYTES_PER_S: u64 = 10 << 30;
/// Longest scrub interval accepted: a year.
const MAX_SCRUB_INTERVAL_S: u64 = 365 * 24 * 3600;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invalid {
    /// Dotted key as written in the file (`qos.workers`).
    pub key: String,
    /// The value given, as it would be written (empty when the message says it all).
    pub value: String,
    /// What is allowed.
    pub allowed: String,
}

impl Invalid {
    fn new(key: impl Into<String>, value: impl fmt::Display, allowed: impl Into<String>) -> Self {
        Invalid {
            key: key.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}: {}", self.key, self.allowed)
        } else {
            write!(f, "{} = {}: {}", self.key, self.value, self.allowed)
        }
    }
}

impl std::error::Error for Invalid {}

/// A size: bytes (`65536`) or a string with a unit (`"64KiB"`, `"2GB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format_size(self.0);
        if text.ends_with("iB") {
            write!(f, "\"{text}\"")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: bytes, or a string such as \"64KiB\", \"4GiB\" or \"2GB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                parse_size(v).map(Size).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

fn de_policy<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PolicyChoice>, D::Error> {
    let text = String::deserialize(d)?;
    text.parse::<PolicyChoice>().map(Some).map_err(|_| {
        de::Error::custom(format!(
            "qos.policy = {text:?}: expected off, wild, base, credit, burst, mclock or drr-vop"
        ))
    })
}

fn de_dispatch<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DispatchMode>, D::Error> {
    let text = String::deserialize(d)?;
    text.parse::<DispatchMode>().map(Some).map_err(|_| {
        de::Error::custom(format!(
            "qos.dispatch = {text:?}: expected one-to-n, one-to-one or stealing"
        ))
    })
}

/// One layer of settings (a file, or the command line). Every key is optional.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigFile {
    pub server: ServerSection,
    pub storage: StorageSection,
    pub limits: LimitsSection,
    pub qos: QosSection,
    pub tls: TlsSection,
    pub metrics: MetricsSection,
    pub api: ApiSection,
    /// Fault injection (a testing tool); absent: off.
    pub faults: Option<FaultsSection>,
}

/// `[metrics]`: which volumes get series of their own in `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Volumes idle longer than this are folded into `volume="_other"`.
    pub volume_series_idle_s: Option<u64>,
    /// Most volumes with series of their own.
    pub max_volume_series: Option<usize>,
}

/// Longest API timeout accepted (`api.*_timeout_ms`).
const MAX_API_TIMEOUT_MS: u64 = 3_600_000;

/// `[api]`: the management API.
#[derive(Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiSection {
    /// The bearer token (under `$HEADROOM_TOKEN`, over the data directory's token file).
    pub token: Option<String>,
    /// Most API connections at once (lowered at start to keep the descriptor reserve).
    pub max_connections: Option<usize>,
    /// From accept (or a later request's first byte) to the request's complete head.
    pub header_read_timeout_ms: Option<u64>,
    /// From a request's head to the end of its body.
    pub body_read_timeout_ms: Option<u64>,
    /// A kept-alive connection between requests.
    pub idle_timeout_ms: Option<u64>,
    /// The audit log of changes [default: DATA_DIR/audit.log].
    pub audit_log: Option<PathBuf>,
}

impl fmt::Debug for ApiSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiSection")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("max_connections", &self.max_connections)
            .field("header_read_timeout_ms", &self.header_read_timeout_ms)
            .field("body_read_timeout_ms", &self.body_read_timeout_ms)
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .field("audit_log", &self.audit_log)
            .finish()
    }
}

/// `[tls]`: TLS on the NBD port (needs a build with `--features tls`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// `identity:hexkey` lines (qemu's `keys.psk`).
    pub psk_file: Option<PathBuf>,
    /// `ca-cert.pem` (optional: verifies client certificates), `server-cert.pem`,
    /// `server-key.pem`.
    pub cert_dir: Option<PathBuf>,
    /// Refuse clients that do not start TLS.
    pub required: Option<bool>,
    /// Client certificate common name to tenant id; required when `ca-cert.pem` is there.
    /// Taken whole from the highest layer that has it.
    pub certificate_tenants: Option<std::collections::BTreeMap<String, String>>,
    /// Also offer TLS 1.2 suites without forward secrecy (plain PSK) and CBC suites.
    pub legacy_cipher_suites: Option<bool>,
    /// TLS handshakes per second per client address group (bursts of twice); 0: no limit.
    pub handshakes_per_s_per_address: Option<u32>,
}

/// `[faults]`: fault injection, a testing tool, off unless the section is there. Taken whole
/// from the highest layer that has it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsSection {
    /// The same seed and the same order of requests give the same faults (default 0).
    pub seed: Option<u64>,
    /// `[[faults.rule]]` tables.
    #[serde(rename = "rule")]
    pub rules: Vec<FaultRuleSection>,
}

/// `[[faults.rule]]`: one [`FaultRule`]; exactly one of `volume` and `device`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultRuleSection {
    /// Every request of this volume.
    pub volume: Option<String>,
    /// Every operation on this pool device (whichever volume).
    pub device: Option<u32>,
    pub offset_bytes: Option<Size>,
    pub length_bytes: Option<Size>,
    pub eio_read_permille: u32,
    pub eio_write_permille: u32,
    pub eio_sync_permille: u32,
    pub enospc_write_permille: u32,
    pub enospc_sync_permille: u32,
    pub enospc_after_bytes: Option<Size>,
    pub latency_spike_permille: u32,
    pub latency_spike_ms: u64,
    pub disappear_after_ops: Option<u64>,
    pub disappear_after_ms: Option<u64>,
}

impl FaultsSection {
    /// The store's fault configuration; the error names `faults.rule[i].KEY`.
    pub fn config(&self) -> Result<FaultConfig, Invalid> {
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.iter().enumerate() {
            let key = |k: &str| format!("faults.rule[{i}].{k}");
            let scope = match (&r.volume, r.device) {
                (Some(name), None) => FaultScope::Volume(name.clone()),
                (None, Some(id)) => FaultScope::Device(id),
                _ => {
                    return Err(Invalid::new(
                        format!("faults.rule[{i}]"),
                        "",
                        "needs exactly one of volume = \"NAME\" and device = ID",
                    ));
                }
            };
            let rule = FaultRule {
                scope,
                offset_bytes: r.offset_bytes.map_or(0, |s| s.0),
                length_bytes: r.length_bytes.map(|s| s.0),
                eio_read_permille: r.eio_read_permille,
                eio_write_permille: r.eio_write_permille,
                eio_sync_permille: r.eio_sync_permille,
                enospc_write_permille: r.enospc_write_permille,
                enospc_sync_permille: r.enospc_sync_permille,
                enospc_after_bytes: r.enospc_after_bytes.map(|s| s.0),
                latency_spike_permille: r.latency_spike_permille,
                latency_spike_ms: r.latency_spike_ms,
                disappear_after_ops: r.disappear_after_ops,
                disappear_after_ms: r.disappear_after_ms,
            };
            rule.validate()
                .map_err(|e| Invalid::new(key(&e.key), e.value, e.allowed))?;
            if rule.is_inert() {
                return Err(Invalid::new(
                    format!("faults.rule[{i}]"),
                    "",
                    "does nothing: set a *_permille, enospc_after_bytes or disappear_after_* key",
                ));
            }
            rules.push(rule);
        }
        Ok(FaultConfig {
            seed: self.seed.unwrap_or(0),
            rules,
        })
    }
}

/// The fault injection in force: `None` without a `[faults]` section or rules.
pub fn faults_config(layer: &ConfigFile) -> Result<Option<FaultConfig>, Invalid> {
    match &layer.faults {
        None => Ok(None),
        Some(section) => {
            let config = section.config()?;
            Ok((!config.rules.is_empty()).then_some(config))
        }
    }
}

/// `[server]`: listeners and the I/O threads.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    pub nbd_listen: Option<SocketAddr>,
    pub api_listen: Option<SocketAddr>,
    pub io_threads: Option<usize>,
    pub inline_max_bytes: Option<Size>,
    pub coalesce_us: Option<u64>,
    pub net_threads: Option<usize>,
}

/// Largest `[storage] metadata_reserve`: far more than any pool's metadata needs.
const MAX_METADATA_RESERVE_BYTES: u64 = 64 << 30;

/// `[storage]`: where the data lives, and an optional emulated device in front of it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StorageSection {
    pub data_dir: Option<PathBuf>,
    /// Give new device files and block devices per-block checksums (absent: true).
    pub checksums: Option<bool>,
    /// Most volume bytes per pool byte (>= 1.0); absent: no limit (thin, as before).
    pub overcommit_ratio: Option<f64>,
    pub memory: Option<Size>,
    pub devices: Option<u32>,
    pub device_size: Option<Size>,
    pub device_paths: Option<Vec<PathBuf>>,
    /// Directories whose regular files `device add` may use or create (absent:
    /// `DATA_DIR/devices/` only).
    pub device_dirs: Option<Vec<PathBuf>>,
    /// Block devices `device add` may use (absent: none).
    pub block_devices: Option<Vec<PathBuf>>,
    /// Largest device `device add` takes (absent: 64 TiB).
    pub max_device_bytes: Option<Size>,
    /// Largest volume that may be created or grown to (absent and at most: 64 TiB).
    pub max_volume_bytes: Option<Size>,
    /// Disk space held back in the data directory for metadata commits when the disk is
    /// full (`meta-reserve`; absent: 64 MiB; 0: none).
    pub metadata_reserve: Option<Size>,
    /// Which copy of a replicated volume serves a read (`headroom_qos::routing`).
    pub read_routing: Option<ReadRouting>,
    /// With `rados_pool`: keep the extents in that Ceph RADOS pool (feature `rados`).
    pub rados_conf: Option<PathBuf>,
    pub rados_pool: Option<String>,
    /// The cephx user the node connects as, without `client.` (absent: `admin`).
    pub rados_id: Option<String>,
    /// The namespace of an existing RADOS store to open (another node's store, on failover).
    pub rados_namespace: Option<String>,
    /// The lease's duration in ms (renewed every third of it).
    pub rados_lease_ms: Option<u64>,
    /// How long to wait at start for another node's lease to expire (absent: no limit).
    pub rados_lease_wait_ms: Option<u64>,
    /// After losing the lease, how long to keep answering `/readyz` (503) before exiting
    /// with status 3 (absent: 5000).
    pub rados_lease_lost_linger_ms: Option<u64>,
    /// Cross-node arbitration of the pool's capacity with the other nodes on it.
    pub rados_arbitration: Option<bool>,
    /// The pool's capacity shared by all nodes, operations per second (with arbitration).
    pub rados_capacity_iops: Option<u64>,
    /// The pool's capacity shared by all nodes, bytes per second (absent: IOPS only).
    pub rados_capacity_bytes_per_s: Option<Size>,
    /// This node's id among the nodes on the pool (absent: `<hostname>-<NBD port>`).
    pub rados_node_id: Option<String>,
    /// This node's weight in the split of what baselines leave (absent: 1).
    pub rados_weight: Option<u64>,
    /// How often nodes report and the arbiter splits, ms (absent: 500).
    pub rados_arbitration_epoch_ms: Option<u64>,
    pub emulated: Option<EmulatedSection>,
    pub rebuild: Option<RebuildSection>,
    pub scrub: Option<ScrubSection>,
}

/// `[storage.scrub]`: the background scrub that verifies every allocated block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrubSection {
    /// Bytes per second the scrub reads at (`PUT /v1/scrub` changes it live).
    pub rate: Option<Size>,
    /// Seconds from the start of one pass to the start of the next (0: only on demand).
    pub interval_s: Option<u64>,
}

/// `[storage.rebuild]`: the rebuild of lost copies after a device failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RebuildSection {
    /// Bytes per second the rebuild starts at (`PUT /v1/rebuild` changes it live).
    pub rate: Option<Size>,
    /// Read and write errors after which a device is failed for good (0: never).
    pub fail_device_after_errors: Option<u64>,
}

/// `[storage.emulated]`: [`EmulatedDeviceSpec`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmulatedSection {
    /// The linear model; exactly one of `model` and `curve`.
    #[serde(default)]
    pub model: Option<IoCostSection>,
    /// A non-linear cost curve (Libra's VOP curve, the keys of `qos.cost.device.vop`).
    #[serde(default)]
    pub curve: Option<VopSection>,
    pub parallelism: u32,
    #[serde(default)]
    pub write_interference_permille: u32,
    #[serde(default)]
    pub per_device: bool,
    #[serde(default)]
    pub streams: u32,
}

/// An IOCost linear model ([`IoCostModel`]); `rbps`/`wbps` accept sizes (`"200MB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCostSection {
    pub rbps: Size,
    pub rseqiops: u64,
    pub rrandiops: u64,
    pub wbps: Size,
    pub wseqiops: u64,
    pub wrandiops: u64,
}

impl IoCostSection {
    pub fn model(&self) -> IoCostModel {
        IoCostModel {
            rbps: self.rbps.0,
            rseqiops: self.rseqiops,
            rrandiops: self.rrandiops,
            wbps: self.wbps.0,
            wseqiops: self.wseqiops,
            wrandiops: self.wrandiops,
        }
    }

    fn check(&self, prefix: &str) -> Result<(), Invalid> {
        let m = self.model();
        for (key, value) in [
            ("rbps", m.rbps),
            ("rseqiops", m.rseqiops),
            ("rrandiops", m.rrandiops),
            ("wbps", m.wbps),
            ("wseqiops", m.wseqiops),
            ("wrandiops", m.wrandiops),
        ] {
            if value == 0 {
                return Err(Invalid::new(
                    format!("{prefix}.{key}"),
                    0,
                    "every rate must be greater than 0",
                ));
            }
        }
        Ok(())
    }
}

/// `[limits]`: what clients can make the server hold ([`Limits`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    pub max_connections: Option<usize>,
    /// Absent: `max_connections` (no cap per address).
    pub max_connections_per_ip: Option<usize>,
    /// IPv6 clients sharing this prefix are one address for `max_connections_per_ip`.
    pub ipv6_prefix_len: Option<u8>,
    pub max_inflight_requests: Option<usize>,
    /// Per connection.
    pub max_inflight_bytes: Option<Size>,
    pub max_inflight_bytes_per_tenant: Option<Size>,
    pub max_inflight_bytes_per_node: Option<Size>,
    pub max_request_bytes: Option<Size>,
    pub handshake_timeout_ms: Option<u64>,
    pub client_stall_timeout_ms: Option<u64>,
}

/// `[qos]`: the scheduler ([`QosConfig`]).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QosSection {
    #[serde(deserialize_with = "de_policy")]
    pub policy: Option<PolicyChoice>,
    pub workers: Option<usize>,
    #[serde(deserialize_with = "de_dispatch")]
    pub dispatch: Option<DispatchMode>,
    pub credit_save_period_ms: Option<u64>,
    pub burst_in_flight: Option<u32>,
    pub global_pool: Option<bool>,
    pub capacity: CapacitySection,
    pub params: ParamsSection,
    pub cost: CostSection,
}

/// `[qos.capacity]`: what the whole node can do per second (absent: unlimited, except CPU).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacitySection {
    pub cpu_ns_per_s: Option<u64>,
    pub ingress_bytes_per_s: Option<Size>,
    pub egress_bytes_per_s: Option<Size>,
    pub device_units_per_s: Option<u64>,
}

/// `[qos.params]`: [`PolicyParams`] field by field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParamsSection {
    pub window_ns: Option<u64>,
    pub limiter_depth_ns: Option<u64>,
    pub pacer_depth_ns: Option<u64>,
    pub history_windows: Option<u32>,
    pub alpha_permille: Option<u32>,
    pub throttle_weight_permille: Option<u32>,
    pub reserve_permille: Option<u32>,
    pub drr_quantum_device_units: Option<u64>,
    pub seed: Option<u64>,
    pub track_invariants: Option<bool>,
    pub reorder_lookahead: Option<u32>,
}

impl ParamsSection {
    /// The server's defaults (`track_invariants` off in a release build) with this layer's
    /// values over them.
    pub fn params(&self) -> PolicyParams {
        let d = headroom_node::config::QosConfig::server_params();
        PolicyParams {
            window_ns: self.window_ns.unwrap_or(d.window_ns),
            limiter_depth_ns: self.limiter_depth_ns.unwrap_or(d.limiter_depth_ns),
            pacer_depth_ns: self.pacer_depth_ns.unwrap_or(d.pacer_depth_ns),
            history_windows: self.history_windows.unwrap_or(d.history_windows),
            alpha_permille: self.alpha_permille.unwrap_or(d.alpha_permille),
            throttle_weight_permille: self
                .throttle_weight_permille
                .unwrap_or(d.throttle_weight_permille),
            reserve_permille: self.reserve_permille.unwrap_or(d.reserve_permille),
            drr_quantum_device_units: self
                .drr_quantum_device_units
                .unwrap_or(d.drr_quantum_device_units),
            seed: self.seed.unwrap_or(d.seed),
            track_invariants: self.track_invariants.unwrap_or(d.track_invariants),
            reorder_lookahead: self.reorder_lookahead.unwrap_or(d.reorder_lookahead),
        }
    }

    fn over(self, lower: ParamsSection) -> ParamsSection {
        ParamsSection {
            window_ns: self.window_ns.or(lower.window_ns),
            limiter_depth_ns: self.limiter_depth_ns.or(lower.limiter_depth_ns),
            pacer_depth_ns: self.pacer_depth_ns.or(lower.pacer_depth_ns),
            history_windows: self.history_windows.or(lower.history_windows),
            alpha_permille: self.alpha_permille.or(lower.alpha_permille),
            throttle_weight_permille: self
                .throttle_weight_permille
                .or(lower.throttle_weight_permille),
            reserve_permille: self.reserve_permille.or(lower.reserve_permille),
            drr_quantum_device_units: self
                .drr_quantum_device_units
                .or(lower.drr_quantum_device_units),
            seed: self.seed.or(lower.seed),
            track_invariants: self.track_invariants.or(lower.track_invariants),
            reorder_lookahead: self.reorder_lookahead.or(lower.reorder_lookahead),
        }
    }
}

/// `[qos.cost]`: the cost model the scheduler charges requests with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostSection {
    pub cpu: CpuSection,
    pub device: Option<DeviceSection>,
    /// Gimbal/Flint write-cost AIMD on device units of writes (absent: on).
    pub write_cost_aimd: Option<bool>,
}

/// `[qos.cost.cpu]`: one line per op kind (absent: BurstCBS's numbers, [`CpuModel::default`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CpuSection {
    pub read: Option<LinearCpuSection>,
    pub write: Option<LinearCpuSection>,
    pub other: Option<LinearCpuSection>,
    pub sync: Option<LinearCpuSection>,
}

/// CPU cost of one op kind: `base_ns + KiB × per_kib_ps / 1000` ([`LinearCpu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearCpuSection {
    pub base_ns: u64,
    pub per_kib_ps: u64,
}

impl LinearCpuSection {
    pub fn line(&self) -> LinearCpu {
        LinearCpu {
            base_ns: self.base_ns,
            per_kib_ps: self.per_kib_ps,
        }
    }
}

/// `qos.cost.device`: `"none"`, `{ linear = { rbps = ..., ... } }` or
/// `{ vop = { max_iops = ..., read = [[size, iops], ...], write = [...] } }`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceSection {
    None,
    Linear(IoCostSection),
    Vop(VopSection),
}

/// A Libra VOP curve ([`VopCurve`]); sizes accept units (`["4KiB", 20000]`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VopSection {
    /// One VOP; absent: the largest achieved IOPS of the two curves.
    #[serde(default)]
    pub max_iops: Option<u64>,
    pub read: Vec<(Size, u64)>,
    pub write: Vec<(Size, u64)>,
}

impl VopSection {
    pub fn curve(&self) -> VopCurve {
        let points = |v: &[(Size, u64)]| v.iter().map(|&(s, iops)| (s.0, iops)).collect();
        let read: Vec<(u64, u64)> = points(&self.read);
        let write: Vec<(u64, u64)> = points(&self.write);
        let max_iops = self
            .max_iops
            .unwrap_or_else(|| read.iter().chain(&write).map(|p| p.1).max().unwrap_or(1));
        VopCurve {
            max_iops,
            read,
            write,
        }
    }

    fn check(&self, prefix: &str) -> Result<(), Invalid> {
        if self.max_iops == Some(0) {
            return Err(Invalid::new(
                format!("{prefix}.max_iops"),
                0,
                "must be greater than 0",
            ));
        }
        for (name, points) in [("read", &self.read), ("write", &self.write)] {
            let key = format!("{prefix}.{name}");
            if points.is_empty() {
                return Err(Invalid::new(
                    key,
                    "[]",
                    "needs at least one [size, iops] point",
                ));
            }
            let mut previous = 0;
            for &(size, iops) in points {
                let point = format!("[{}, {iops}]", size.0);
                if size.0 <= previous {
                    return Err(Invalid::new(
                        key,
                        point,
                        "sizes must be greater than 0 and increasing",
                    ));
                }
                if iops == 0 {
                    return Err(Invalid::new(key, point, "IOPS must be greater than 0"));
                }
                previous = size.0;
            }
        }
        Ok(())
    }
}

impl DeviceSection {
    pub fn model(&self) -> DeviceModel {
        match self {
            DeviceSection::None => DeviceModel::None,
            DeviceSection::Linear(m) => DeviceModel::Linear(m.model()),
            DeviceSection::Vop(v) => DeviceModel::Vop(v.curve()),
        }
    }

    fn check(&self) -> Result<(), Invalid> {
        match self {
            DeviceSection::None => Ok(()),
            DeviceSection::Linear(m) => m.check("qos.cost.device.linear"),
            DeviceSection::Vop(v) => v.check("qos.cost.device.vop"),
        }
    }
}

impl ConfigFile {
    /// Parses a file's text and checks every value on its own (`origin` names the file in
    /// errors). Checks between keys, which may come from different layers, are [`resolve`]'s.
    pub fn parse(text: &str, origin: &Path) -> Result<ConfigFile> {
        let layer: ConfigFile = toml::from_str(text)
            .with_context(|| format!("configuration file {}", origin.display()))?;
        layer
            .check()
            .with_context(|| format!("configuration file {}", origin.display()))?;
        Ok(layer)
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading configuration file {}", path.display()))?;
        Self::parse(&text, path)
    }

    /// This layer's keys where it has them, `lower`'s elsewhere (see the module doc for the
    /// keys merged as a unit).
    pub fn over(self, lower: ConfigFile) -> ConfigFile {
        let (s, l) = (self.server, lower.server);
        let server = ServerSection {
            nbd_listen: s.nbd_listen.or(l.nbd_listen),
            api_listen: s.api_listen.or(l.api_listen),
            io_threads: s.io_threads.or(l.io_threads),
            inline_max_bytes: s.inline_max_bytes.or(l.inline_max_bytes),
            coalesce_us: s.coalesce_us.or(l.coalesce_us),
            net_threads: s.net_threads.or(l.net_threads),
        };
        let (s, l) = (self.storage, lower.storage);
        let storage = StorageSection {
            data_dir: s.data_dir.or(l.data_dir),
            overcommit_ratio: s.overcommit_ratio.or(l.overcommit_ratio),
            memory: s.memory.or(l.memory),
            devices: s.devices.or(l.devices),
            device_size: s.device_size.or(l.device_size),
            device_paths: s.device_paths.or(l.device_paths),
            device_dirs: s.device_dirs.or(l.device_dirs),
            block_devices: s.block_devices.or(l.block_devices),
            max_device_bytes: s.max_device_bytes.or(l.max_device_bytes),
            max_volume_bytes: s.max_volume_bytes.or(l.max_volume_bytes),
            metadata_reserve: s.metadata_reserve.or(l.metadata_reserve),
            checksums: s.checksums.or(l.checksums),
            read_routing: s.read_routing.or(l.read_routing),
            rados_conf: s.rados_conf.or(l.rados_conf),
            rados_pool: s.rados_pool.or(l.rados_pool),
            rados_id: s.rados_id.or(l.rados_id),
            rados_namespace: s.rados_namespace.or(l.rados_namespace),
            rados_lease_ms: s.rados_lease_ms.or(l.rados_lease_ms),
            rados_lease_wait_ms: s.rados_lease_wait_ms.or(l.rados_lease_wait_ms),
            rados_lease_lost_linger_ms: s
                .rados_lease_lost_linger_ms
                .or(l.rados_lease_lost_linger_ms),
            rados_arbitration: s.rados_arbitration.or(l.rados_arbitration),
            rados_capacity_iops: s.rados_capacity_iops.or(l.rados_capacity_iops),
            rados_capacity_bytes_per_s: s
                .rados_capacity_bytes_per_s
                .or(l.rados_capacity_bytes_per_s),
            rados_node_id: s.rados_node_id.or(l.rados_node_id),
            rados_weight: s.rados_weight.or(l.rados_weight),
            rados_arbitration_epoch_ms: s
                .rados_arbitration_epoch_ms
                .or(l.rados_arbitration_epoch_ms),
            emulated: s.emulated.or(l.emulated),
            rebuild: match (s.rebuild, l.rebuild) {
                (Some(s), Some(l)) => Some(RebuildSection {
                    rate: s.rate.or(l.rate),
                    fail_device_after_errors: s
                        .fail_device_after_errors
                        .or(l.fail_device_after_errors),
                }),
                (s, l) => s.or(l),
            },
            scrub: match (s.scrub, l.scrub) {
                (Some(s), Some(l)) => Some(ScrubSection {
                    rate: s.rate.or(l.rate),
                    interval_s: s.interval_s.or(l.interval_s),
                }),
                (s, l) => s.or(l),
            },
        };
        let (s, l) = (self.limits, lower.limits);
        let limits = LimitsSection {
            max_connections: s.max_connections.or(l.max_connections),
            max_connections_per_ip: s.max_connections_per_ip.or(l.max_connections_per_ip),
            ipv6_prefix_len: s.ipv6_prefix_len.or(l.ipv6_prefix_len),
            max_inflight_requests: s.max_inflight_requests.or(l.max_inflight_requests),
            max_inflight_bytes: s.max_inflight_bytes.or(l.max_inflight_bytes),
            max_inflight_bytes_per_tenant: s
                .max_inflight_bytes_per_tenant
                .or(l.max_inflight_bytes_per_tenant),
            max_inflight_bytes_per_node: s
                .max_inflight_bytes_per_node
                .or(l.max_inflight_bytes_per_node),
            max_request_bytes: s.max_request_bytes.or(l.max_request_bytes),
            handshake_timeout_ms: s.handshake_timeout_ms.or(l.handshake_timeout_ms),
            client_stall_timeout_ms: s.client_stall_timeout_ms.or(l.client_stall_timeout_ms),
        };
        let (s, l) = (self.qos, lower.qos);
        // The layer that picks the device model also picks the device capacity (its unit).
        let device_units_per_s = if s.cost.device.is_some() {
            s.capacity.device_units_per_s
        } else {
            s.capacity
                .device_units_per_s
                .or(l.capacity.device_units_per_s)
        };
        let qos = QosSection {
            policy: s.policy.or(l.policy),
            workers: s.workers.or(l.workers),
            dispatch: s.dispatch.or(l.dispatch),
            credit_save_period_ms: s.credit_save_period_ms.or(l.credit_save_period_ms),
            burst_in_flight: s.burst_in_flight.or(l.burst_in_flight),
            global_pool: s.global_pool.or(l.global_pool),
            capacity: CapacitySection {
                cpu_ns_per_s: s.capacity.cpu_ns_per_s.or(l.capacity.cpu_ns_per_s),
                ingress_bytes_per_s: s
                    .capacity
                    .ingress_bytes_per_s
                    .or(l.capacity.ingress_bytes_per_s),
                egress_bytes_per_s: s
                    .capacity
                    .egress_bytes_per_s
                    .or(l.capacity.egress_bytes_per_s),
                device_units_per_s,
            },
            params: s.params.over(l.params),
            cost: CostSection {
                cpu: CpuSection {
                    read: s.cost.cpu.read.or(l.cost.cpu.read),
                    write: s.cost.cpu.write.or(l.cost.cpu.write),
                    other: s.cost.cpu.other.or(l.cost.cpu.other),
                    sync: s.cost.cpu.sync.or(l.cost.cpu.sync),
                },
                device: s.cost.device.or(l.cost.device),
                write_cost_aimd: s.cost.write_cost_aimd.or(l.cost.write_cost_aimd),
            },
        };
        let (s, l) = (self.tls, lower.tls);
        let tls = TlsSection {
            psk_file: s.psk_file.or(l.psk_file),
            cert_dir: s.cert_dir.or(l.cert_dir),
            required: s.required.or(l.required),
            certificate_tenants: s.certificate_tenants.or(l.certificate_tenants),
            legacy_cipher_suites: s.legacy_cipher_suites.or(l.legacy_cipher_suites),
            handshakes_per_s_per_address: s
                .handshakes_per_s_per_address
                .or(l.handshakes_per_s_per_address),
        };
        let (s, l) = (self.metrics, lower.metrics);
        let metrics = MetricsSection {
            volume_series_idle_s: s.volume_series_idle_s.or(l.volume_series_idle_s),
            max_volume_series: s.max_volume_series.or(l.max_volume_series),
        };
        let (s, l) = (self.api, lower.api);
        let api = ApiSection {
            token: s.token.or(l.token),
            max_connections: s.max_connections.or(l.max_connections),
            header_read_timeout_ms: s.header_read_timeout_ms.or(l.header_read_timeout_ms),
            body_read_timeout_ms: s.body_read_timeout_ms.or(l.body_read_timeout_ms),
            idle_timeout_ms: s.idle_timeout_ms.or(l.idle_timeout_ms),
            audit_log: s.audit_log.or(l.audit_log),
        };
        ConfigFile {
            server,
            storage,
            limits,
            qos,
            tls,
            metrics,
            api,
            faults: self.faults.or(lower.faults),
        }
    }

    /// The data directory in force (where `calibration.toml` is looked for).
    pub fn data_dir(&self) -> PathBuf {
        self.storage
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
    }

    /// Checks every value that can be checked on its own.
    pub fn check(&self) -> Result<(), Invalid> {
        let sv = &self.server;
        if let Some(n) = sv.io_threads {
            setting::check_io_threads(n).map_err(setting_invalid)?;
        }
        if let Some(size) = sv.inline_max_bytes
            && u32::try_from(size.0).is_err()
        {
            return Err(Invalid::new(
                "server.inline_max_bytes",
                size,
                "must be less than 4GiB",
            ));
        }
        if let Some(us) = sv.coalesce_us {
            setting::check_coalesce_us(us).map_err(setting_invalid)?;
        }

        if let Some(n) = sv.net_threads {
            setting::check_net_threads(n).map_err(setting_invalid)?;
        }

        let st = &self.storage;
        if let Some(size) = st.memory
            && size.0 == 0
        {
            return Err(Invalid::new(
                "storage.memory",
                size,
                "must be greater than 0",
            ));
        }
        if let (Some(size), Some(_)) = (st.metadata_reserve, st.memory) {
            return Err(Invalid::new(
                "storage.metadata_reserve",
                size,
                "a RAM store keeps no metadata on disk; leave it out with storage.memory",
            ));
        }
        if let Some(size) = st.metadata_reserve
            && size.0 > MAX_METADATA_RESERVE_BYTES
        {
            return Err(Invalid::new(
                "storage.metadata_reserve",
                size,
                "must be at most 64GiB (0: no reserve)",
            ));
        }
        if let Some(ratio) = st.overcommit_ratio
            && !(ratio.is_finite() && ratio >= 1.0)
        {
            return Err(Invalid::new(
                "storage.overcommit_ratio",
                ratio,
                "must be a number of at least 1.0 (1.0: no overcommit; leave it out for no limit)",
            ));
        }
        if let Some(0) = st.devices {
            return Err(Invalid::new("storage.devices", 0, "must be at least 1"));
        }
        for (key, paths) in [
            ("storage.device_dirs", &st.device_dirs),
            ("storage.block_devices", &st.block_devices),
        ] {
            for path in paths.iter().flatten() {
                if !path.is_absolute() || path.to_str().is_none_or(|p| p.contains('\0')) {
                    return Err(Invalid::new(
                        key,
                        path.display(),
                        "each entry must be an absolute UTF-8 path",
                    ));
                }
            }
        }
        let least_device = 2 * headroom_store::EXTENT_SIZE_BYTES;
        if let Some(size) = st.max_device_bytes
            && size.0 < least_device
        {
            return Err(Invalid::new(
                "storage.max_device_bytes",
                size,
                format!("must be at least {least_device} (two extents, one for the signature)"),
            ));
        }
        if let Some(size) = st.max_volume_bytes
            && !(headroom_store::VOLUME_SIZE_ALIGN_BYTES..=headroom_store::MAX_VOLUME_SIZE_BYTES)
                .contains(&size.0)
        {
            return Err(Invalid::new(
                "storage.max_volume_bytes",
                size,
                format!(
                    "must be between {} and {} (64 TiB)",
                    headroom_store::VOLUME_SIZE_ALIGN_BYTES,
                    headroom_store::MAX_VOLUME_SIZE_BYTES
                ),
            ));
        }
        if let Some(size) = st.device_size
            && size.0 == 0
        {
            return Err(Invalid::new(
                "storage.device_size",
                size,
                "must be greater than 0",
            ));
        }
        if let Some(pool) = &st.rados_pool
            && (pool.is_empty() || pool.contains(['/', '\0']))
        {
            return Err(Invalid::new(
                "storage.rados_pool",
                format!("{pool:?}"),
                "must be a pool name: not empty, no '/'",
            ));
        }
        if let Some(id) = &st.rados_id
            && let Err(why) = headroom_store::validate_rados_id(id)
        {
            return Err(Invalid::new("storage.rados_id", format!("{id:?}"), why));
        }
        if let Some(ns) = &st.rados_namespace
            && (ns.is_empty() || ns.contains(['/', '\0']))
        {
            return Err(Invalid::new(
                "storage.rados_namespace",
                format!("{ns:?}"),
                "must be a namespace name: not empty, no '/'",
            ));
        }
        if let Some(ms) = st.rados_lease_ms
            && !(100..=3_600_000).contains(&ms)
        {
            return Err(Invalid::new(
                "storage.rados_lease_ms",
                ms,
                "must be between 100 and 3600000",
            ));
        }
        if let Some(ms) = st.rados_lease_lost_linger_ms
            && ms > 600_000
        {
            return Err(Invalid::new(
                "storage.rados_lease_lost_linger_ms",
                ms,
                "must be at most 600000 (10 minutes)",
            ));
        }
        for (key, set) in [
            ("storage.rados_id", st.rados_id.is_some()),
            (
                "storage.rados_lease_lost_linger_ms",
                st.rados_lease_lost_linger_ms.is_some(),
            ),
            ("storage.rados_namespace", st.rados_namespace.is_some()),
            ("storage.rados_lease_ms", st.rados_lease_ms.is_some()),
            (
                "storage.rados_lease_wait_ms",
                st.rados_lease_wait_ms.is_some(),
            ),
        ] {
            if set && st.rados_pool.is_none() {
                return Err(Invalid::new(
                    key,
                    "set",
                    "needs storage.rados_pool (--rados-pool)",
                ));
            }
        }
        if let Some(e) = &st.emulated {
            match (&e.model, &e.curve) {
                (Some(_), Some(_)) => {
                    return Err(Invalid::new(
                        "storage.emulated.curve",
                        "(a table)",
                        "give either model (linear) or curve (non-linear), not both",
                    ));
                }
                (None, None) => {
                    return Err(Invalid::new(
                        "storage.emulated.model",
                        "(missing)",
                        "needs model (linear) or curve (non-linear)",
                    ));
                }
                (None, Some(c)) => c.check("storage.emulated.curve")?,
                (Some(_), None) => {}
            }
            emulated_spec(e).validate().map_err(|err| match err {
                EmulatedError::Invalid {
                    key,
                    value,
                    allowed,
                } => Invalid::new(format!("storage.emulated.{key}"), value, allowed),
                other => Invalid::new("storage.emulated", "", other.to_string()),
            })?;
        }

        let li = &self.limits;
        if let Some(0) = li.max_connections {
            return Err(Invalid::new(
                "limits.max_connections",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.max_inflight_requests {
            return Err(Invalid::new(
                "limits.max_inflight_requests",
                0,
                "must be at least 1",
            ));
        }
        if let Some(size) = li.max_request_bytes
            && !(MIN_REQUEST_BYTES..=MAX_REQUEST_BYTES).contains(&size.0)
        {
            return Err(Invalid::new(
                "limits.max_request_bytes",
                size,
                format!(
                    "must be between {} and {} (the NBD layer's limit)",
                    format_size(MIN_REQUEST_BYTES),
                    format_size(MAX_REQUEST_BYTES)
                ),
            ));
        }
        if let Some(size) = li.max_inflight_bytes
            && (size.0 == 0 || u32::try_from(size.0).is_err())
        {
            return Err(Invalid::new(
                "limits.max_inflight_bytes",
                size,
                "must be greater than 0 and less than 4GiB",
            ));
        }
        if let Some(0) = li.handshake_timeout_ms {
            return Err(Invalid::new(
                "limits.handshake_timeout_ms",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.max_connections_per_ip {
            return Err(Invalid::new(
                "limits.max_connections_per_ip",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.client_stall_timeout_ms {
            return Err(Invalid::new(
                "limits.client_stall_timeout_ms",
                0,
                "must be at least 1",
            ));
        }

        let q = &self.qos;
        if let Some(n) = q.workers {
            qos_setting::check_workers(n).map_err(setting_invalid)?;
        }
        if let Some(n) = q.burst_in_flight {
            qos_setting::check_burst_in_flight(n).map_err(setting_invalid)?;
        }
        if let Some(0) = q.credit_save_period_ms {
            return Err(Invalid::new(
                "qos.credit_save_period_ms",
                0,
                "must be at least 1",
            ));
        }
        let c = &q.capacity;
        for (key, value) in [
            ("qos.capacity.cpu_ns_per_s", c.cpu_ns_per_s),
            (
                "qos.capacity.ingress_bytes_per_s",
                c.ingress_bytes_per_s.map(|s| s.0),
            ),
            (
                "qos.capacity.egress_bytes_per_s",
                c.egress_bytes_per_s.map(|s| s.0),
            ),
            ("qos.capacity.device_units_per_s", c.device_units_per_s),
        ] {
            if value == Some(0) {
                return Err(Invalid::new(
                    key,
                    0,
                    "must be greater than 0 (leave it out for unlimited)",
                ));
            }
        }
        q.params
            .params()
            .validate()
            .map_err(|err| Invalid::new("qos.params", "", err.to_string()))?;
        for (name, line) in [
            ("read", q.cost.cpu.read),
            ("write", q.cost.cpu.write),
            ("other", q.cost.cpu.other),
            ("sync", q.cost.cpu.sync),
        ] {
            if let Some(line) = line
                && line.base_ns > NS_PER_S
            {
                return Err(Invalid::new(
                    format!("qos.cost.cpu.{name}.base_ns"),
                    line.base_ns,
                    "must be at most 1000000000 (1 s)",
                ));
            }
        }
        if let Some(device) = &q.cost.device {
            device.check()?;
        }
        if let Some(faults) = &self.faults {
            faults.config()?;
        }
        if let Some(token) = &self.api.token {
            headroom_node::api::ApiToken::new(token)
                .map_err(|err| Invalid::new("api.token", "(hidden)", err.to_string()))?;
        }
        if let Some(0) = self.api.max_connections {
            return Err(Invalid::new("api.max_connections", 0, "must be at least 1"));
        }
        for (key, value) in [
            (
                "api.header_read_timeout_ms",
                self.api.header_read_timeout_ms,
            ),
            ("api.body_read_timeout_ms", self.api.body_read_timeout_ms),
            ("api.idle_timeout_ms", self.api.idle_timeout_ms),
        ] {
            if let Some(ms) = value
                && !(1..=MAX_API_TIMEOUT_MS).contains(&ms)
            {
                return Err(Invalid::new(
                    key,
                    ms,
                    format!("must be between 1 and {MAX_API_TIMEOUT_MS} (1 h)"),
                ));
            }
        }
        Ok(())
    }
}

fn emulated_spec(e: &EmulatedSection) -> EmulatedDeviceSpec {
    // With a curve the device's costs come from it; `model` then only records a linear summary
    // of the curve (4 KiB IOPS, bandwidth at its largest point), which nothing charges.
    let model = match (&e.model, &e.curve) {
        (Some(m), _) => m.model(),
        (None, Some(c)) => {
            let c = c.curve();
            let summary = |points: &[(u64, u64)]| {
                let iops = VopCurve::achieved_iops(points, 4096).max(1);
                let bps = points
                    .last()
                    .map_or(1, |&(size, iops)| size.saturating_mul(iops))
                    .max(1);
                (bps, iops)
            };
            let (rbps, riops) = summary(&c.read);
            let (wbps, wiops) = summary(&c.write);
            IoCostModel {
                rbps,
                rseqiops: riops,
                rrandiops: riops,
                wbps,
                wseqiops: wiops,
                wrandiops: wiops,
            }
        }
        (None, None) => IoCostModel::SSD_DFL,
    };
    EmulatedDeviceSpec {
        model,
        parallelism: e.parallelism,
        write_interference_permille: e.write_interference_permille,
        per_device: e.per_device,
        streams: e.streams,
    }
}

/// The RADOS cluster configuration and pool, when `storage.rados_*` is set: both keys
/// together, nothing that names local devices or RAM, and a build with the backend.
fn rados_target(st: &StorageSection) -> Result<Option<(PathBuf, String)>, Invalid> {
    let (conf, pool) = match (&st.rados_conf, &st.rados_pool) {
        (None, None) => return Ok(None),
        (Some(conf), Some(pool)) => (conf.clone(), pool.clone()),
        (Some(conf), None) => {
            return Err(Invalid::new(
                "storage.rados_conf",
                conf.display(),
                "needs storage.rados_pool (--rados-pool) too",
            ));
        }
        (None, Some(pool)) => {
            return Err(Invalid::new(
                "storage.rados_pool",
                pool,
                "needs storage.rados_conf (--rados-conf) too",
            ));
        }
    };
    if !headroom_store::RADOS_SUPPORTED {
        return Err(Invalid::new(
            "storage.rados_pool",
            &pool,
            "this headroom was built without the RADOS backend; rebuild with --features rados \
             (cargo build --release -p headroom --features rados; needs librados-dev)",
        ));
    }
    let conflict = if st.memory.is_some() {
        Some("storage.memory")
    } else if st.devices.is_some() {
        Some("storage.devices")
    } else if st.device_paths.is_some() {
        Some("storage.device_paths")
    } else {
        None
    };
    if let Some(key) = conflict {
        return Err(Invalid::new(
            "storage.rados_pool",
            &pool,
            format!("keeps the data in RADOS; leave out {key}"),
        ));
    }
    Ok(Some((conf, pool)))
}

/// Applies the built-in defaults to a merged layer and checks it whole: the configuration
/// `Node::start` gets.
pub fn resolve(layer: &ConfigFile) -> Result<NodeConfig, Invalid> {
    layer.check()?;
    let st = &layer.storage;
    let rados = rados_target(st)?;
    let backend = match (st.memory, rados) {
        (Some(size), _) => StoreBackend::Memory {
            capacity_bytes: size.0,
        },
        (None, Some((conf, pool))) => StoreBackend::Rados {
            data_dir: layer.data_dir(),
            conf,
            id: st
                .rados_id
                .clone()
                .unwrap_or_else(|| headroom_store::DEFAULT_RADOS_ID.to_owned()),
            pool,
            capacity_bytes: st.device_size.map_or(DEFAULT_DEVICE_SIZE, |s| s.0),
            namespace: st.rados_namespace.clone(),
            lease_ms: st
                .rados_lease_ms
                .unwrap_or(headroom_store::DEFAULT_LEASE_MS),
            lease_wait_ms: st.rados_lease_wait_ms,
            lease_lost_linger_ms: st
                .rados_lease_lost_linger_ms
                .unwrap_or(headroom_store::DEFAULT_LEASE_LOST_LINGER_MS),
        },
        (None, None) => StoreBackend::Files {
            data_dir: layer.data_dir(),
            device_count: st.devices.unwrap_or(DEFAULT_DEVICES),
            device_capacity_bytes: st.device_size.map_or(DEFAULT_DEVICE_SIZE, |s| s.0),
            device_paths: st.device_paths.clone().unwrap_or_default(),
        },
    };
    let mut config = NodeConfig::new(backend);
    if let Some(size) = st.metadata_reserve {
        config.metadata_reserve_bytes = size.0;
    }
    if let Some(checksums) = st.checksums {
        config.checksums = checksums;
    }

    let api = &layer.api;
    let d = headroom_node::api::conn::ApiLimits::default();
    config.api_limits = headroom_node::api::conn::ApiLimits {
        max_connections: api.max_connections.unwrap_or(d.max_connections),
        header_read_timeout_ms: api
            .header_read_timeout_ms
            .unwrap_or(d.header_read_timeout_ms),
        body_read_timeout_ms: api.body_read_timeout_ms.unwrap_or(d.body_read_timeout_ms),
        idle_timeout_ms: api.idle_timeout_ms.unwrap_or(d.idle_timeout_ms),
    };

    let sv = &layer.server;
    if let Some(addr) = sv.nbd_listen {
        config.nbd_listen = addr;
    }
    if let Some(addr) = sv.api_listen {
        config.api_listen = addr;
    }
    if let Some(n) = sv.io_threads {
        config.io_threads = n;
    }
    if let Some(us) = sv.coalesce_us {
        config.coalesce_us = Some(us);
    }
    if let Some(n) = sv.net_threads {
        config.net_threads = Some(n);
    }
    // `check` made sure it fits.
    config.inline_max_bytes = sv
        .inline_max_bytes
        .map(|s| u32::try_from(s.0).unwrap_or(u32::MAX));
    // Injected latency spikes block the thread a request runs on; run inline on a network
    // thread, a spike would stall every connection of that thread, which no real memory
    // device does. Unless the operator chose an inline size, nothing runs inline then.
    let spikes = layer
        .faults
        .as_ref()
        .is_some_and(|f| f.rules.iter().any(|r| r.latency_spike_permille > 0));
    if spikes && config.inline_max_bytes.is_none() {
        config.inline_max_bytes = Some(0);
    }
    config.emulated_device = st.emulated.as_ref().map(emulated_spec);
    if let Some(routing) = st.read_routing {
        config.read_routing = routing;
    }
    config.emulated_curve = st
        .emulated
        .as_ref()
        .and_then(|e| e.curve.as_ref())
        .map(VopSection::curve);
    config.overcommit_ratio = st.overcommit_ratio;
    config.device_admission = headroom_store::AdmissionPolicy {
        device_dirs: st.device_dirs.clone().unwrap_or_default(),
        block_devices: st.block_devices.clone().unwrap_or_default(),
        max_device_bytes: st
            .max_device_bytes
            .map_or(headroom_store::DEFAULT_MAX_DEVICE_BYTES, |s| s.0),
        max_volume_bytes: st
            .max_volume_bytes
            .map_or(headroom_store::MAX_VOLUME_SIZE_BYTES, |s| s.0),
    };
    if let Some(errors) = st.rebuild.and_then(|r| r.fail_device_after_errors) {
        config.fail_device_after_errors = errors;
    }
    if let Some(rate) = st.rebuild.and_then(|r| r.rate) {
        config.rebuild_rate_bytes_per_s = rate.0.max(1);
    }
    if let Some(scrub) = st.scrub {
        if let Some(rate) = scrub.rate {
            if !(1..=MAX_BACKGROUND_RATE_BYTES_PER_S).contains(&rate.0) {
                return Err(Invalid::new(
                    "storage.scrub.rate",
                    format_size(rate.0),
                    "1 byte to 10GiB per second",
                ));
            }
            config.scrub_rate_bytes_per_s = rate.0;
        }
        if let Some(interval_s) = scrub.interval_s {
            if interval_s > MAX_SCRUB_INTERVAL_S {
                return Err(Invalid::new(
                    "storage.scrub.interval_s",
                    interval_s,
                    "0 (only on demand) to 31536000 (a year)",
                ));
            }
            config.scrub_interval_s = interval_s;
        }
    }

    config.limits = limits(&layer.limits)?;
    if let Some(ms) = layer.qos.credit_save_period_ms {
        config.credit_save_period_ms = ms;
    }
    config.qos = qos_config(&layer.qos)?;
    config.arbitration = arbitration_config(layer, &mut config)?;
    config.tls = tls_config(&layer.tls)?;
    config.metrics = metrics_config(&layer.metrics)?;
    Ok(config)
}

/// Cross-node arbitration (`storage.rados_arbitration`): its settings, and the device cost
/// model and capacity it paces the node in (`headroom_node::arbitration`, "The unit").
fn arbitration_config(
    layer: &ConfigFile,
    config: &mut NodeConfig,
) -> Result<Option<ArbitrationConfig>, Invalid> {
    let st = &layer.storage;
    if st.rados_arbitration != Some(true) {
        for (key, set) in [
            (
                "storage.rados_capacity_iops",
                st.rados_capacity_iops.is_some(),
            ),
            (
                "storage.rados_capacity_bytes_per_s",
                st.rados_capacity_bytes_per_s.is_some(),
            ),
            ("storage.rados_node_id", st.rados_node_id.is_some()),
            ("storage.rados_weight", st.rados_weight.is_some()),
            (
                "storage.rados_arbitration_epoch_ms",
                st.rados_arbitration_epoch_ms.is_some(),
            ),
        ] {
            if set {
                return Err(Invalid::new(
                    key,
                    "set",
                    "needs storage.rados_arbitration = true (--rados-arbitration)",
                ));
            }
        }
        return Ok(None);
    }
    let StoreBackend::Rados { .. } = config.backend else {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "needs the RADOS backend (storage.rados_conf and rados_pool, without memory)",
        ));
    };
    if config.qos.policy.kind().is_none() {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "needs a scheduling policy: qos.policy is off",
        ));
    }
    if layer.qos.cost.device.is_some() || layer.qos.capacity.device_units_per_s.is_some() {
        return Err(Invalid::new(
            "storage.rados_arbitration",
            true,
            "sets the device cost model and capacity itself (from rados_capacity_iops and              rados_capacity_bytes_per_s): remove qos.cost.device and              qos.capacity.device_units_per_s",
        ));
    }
    let iops = match st.rados_capacity_iops {
        Some(iops) if (1..=1_000_000_000).contains(&iops) => iops,
        Some(iops) => {
            return Err(Invalid::new(
                "storage.rados_capacity_iops",
                iops,
                "must be between 1 and 1000000000",
            ));
        }
        None => {
            return Err(Invalid::new(
                "storage.rados_arbitration",
                true,
                "needs storage.rados_capacity_iops (--rados-capacity-iops): the pool's capacity \
                 the nodes share",
            ));
        }
    };
    let bytes = st.rados_capacity_bytes_per_s.map(|s| s.0);
    if let Some(b) = bytes
        && b < iops
    {
        return Err(Invalid::new(
            "storage.rados_capacity_bytes_per_s",
            b,
            format!("must be at least rados_capacity_iops ({iops}): one byte per operation"),
        ));
    }
    let epoch_ms = st
        .rados_arbitration_epoch_ms
        .unwrap_or(headroom_node::arbitration::DEFAULT_EPOCH_MS);
    if !(50..=60_000).contains(&epoch_ms) {
        return Err(Invalid::new(
            "storage.rados_arbitration_epoch_ms",
            epoch_ms,
            "must be between 50 and 60000",
        ));
    }
    let weight = st.rados_weight.unwrap_or(1);
    if !(1..=1_000_000).contains(&weight) {
        return Err(Invalid::new(
            "storage.rados_weight",
            weight,
            "must be between 1 and 1000000",
        ));
    }
    let node_id = match &st.rados_node_id {
        Some(id) => id.clone(),
        None => format!("{}-{}", host_name(), config.nbd_listen.port()),
    };
    if headroom_store::arbiter::validate_node_id(&node_id).is_err() {
        return Err(Invalid::new(
            "storage.rados_node_id",
            format!("{node_id:?}"),
            "must be 1-64 characters of A-Z a-z 0-9 . _ : -",
        ));
    }
    let arb = ArbitrationConfig {
        node_id,
        weight,
        epoch_ms,
        capacity_iops: iops,
        capacity_bytes_per_s: bytes,
        lock_ms: None,
        fallback_epochs: headroom_node::arbitration::DEFAULT_FALLBACK_EPOCHS,
    };
    let workers = u64::try_from(config.qos.workers).unwrap_or(u64::MAX);
    if arb.capacity_units_per_s() < workers.saturating_mul(1000) {
        return Err(Invalid::new(
            "storage.rados_capacity_iops",
            iops,
            "must be at least qos.workers",
        ));
    }
    config.qos.cost_model.device =
        DeviceModel::Vop(headroom_node::arbitration::vop_curve_for(iops, bytes));
    config.qos.capacity.per_second.device_units = arb.capacity_units_per_s();
    Ok(Some(arb))
}

/// The machine's host name, made a valid node id (`node` if there is none).
fn host_name() -> String {
    let name: String = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(48)
        .collect();
    if name.is_empty() { "node".into() } else { name }
}

/// The `[metrics]` table over [`MetricsConfig::default`].
fn metrics_config(m: &MetricsSection) -> Result<MetricsConfig, Invalid> {
    let mut config = MetricsConfig::default();
    if let Some(s) = m.volume_series_idle_s {
        // A year: anything longer is "never idle" anyway, and keeps the arithmetic small.
        const MAX_IDLE_S: u64 = 366 * 24 * 3600;
        if s > MAX_IDLE_S {
            return Err(Invalid::new(
                "metrics.volume_series_idle_s",
                s,
                format!("must be between 0 and {MAX_IDLE_S}"),
            ));
        }
        config.volume_series_idle_s = s;
    }
    if let Some(n) = m.max_volume_series {
        if n > MAX_MAX_VOLUME_SERIES {
            return Err(Invalid::new(
                "metrics.max_volume_series",
                n,
                format!("must be between 0 and {MAX_MAX_VOLUME_SERIES}"),
            ));
        }
        config.max_volume_series = n;
    }
    Ok(config)
}

/// The `[limits]` table over [`Limits::default`], checked as a whole ([`Limits::validate`]:
/// the largest request fits in the per-connection bytes, which fit in the per-tenant bytes,
/// which fit in the node's; the per-address cap in the connection cap).
fn limits(li: &LimitsSection) -> Result<Limits, Invalid> {
    let d = Limits::default();
    let max_connections = li.max_connections.unwrap_or(d.max_connections);
    let limits = Limits {
        max_connections,
        max_connections_per_ip: li.max_connections_per_ip.unwrap_or(max_connections),
        ipv6_prefix_len: li.ipv6_prefix_len.unwrap_or(d.ipv6_prefix_len),
        max_inflight_requests_per_conn: li
            .max_inflight_requests
            .unwrap_or(d.max_inflight_requests_per_conn),
        max_inflight_bytes_per_conn: li
            .max_inflight_bytes
            .map_or(d.max_inflight_bytes_per_conn, |s| s.0),
        max_inflight_bytes_per_tenant: li
            .max_inflight_bytes_per_tenant
            .map_or(d.max_inflight_bytes_per_tenant, |s| s.0),
        max_inflight_bytes_per_node: li
            .max_inflight_bytes_per_node
            .map_or(d.max_inflight_bytes_per_node, |s| s.0),
        max_request_bytes: li.max_request_bytes.map_or(d.max_request_bytes, |s| {
            u32::try_from(s.0).unwrap_or(u32::MAX)
        }),
        handshake_timeout_ms: li.handshake_timeout_ms.unwrap_or(d.handshake_timeout_ms),
        client_stall_timeout_ms: li
            .client_stall_timeout_ms
            .unwrap_or(d.client_stall_timeout_ms),
    };
    limits.validate().map_err(limits_invalid)?;
    Ok(limits)
}

/// A node setting's error, as the node words it (the key is the file's).
fn setting_invalid(err: setting::InvalidSetting) -> Invalid {
    Invalid::new(err.key, err.value, err.allowed)
}

/// A node limits error in this file's words: sizes with units.
fn limits_invalid(err: LimitsError) -> Invalid {
    let key = format!("limits.{}", err.key);
    let is_size = matches!(
        err.key,
        "max_inflight_bytes"
            | "max_inflight_bytes_per_tenant"
            | "max_inflight_bytes_per_node"
            | "max_request_bytes"
    );
    let value = if is_size {
        Size(err.value).to_string()
    } else {
        err.value.to_string()
    };
    let allowed = match err.rule {
        LimitRule::Between { min, max } if is_size => format!(
            "must be between {} and {}",
            format_size(min),
            format_size(max)
        ),
        LimitRule::HoldsLargestRequest {
            request_bytes,
            charge_bytes,
        } => format!(
            "must be at least {}, the buffer a request of limits.max_request_bytes ({}) \
             occupies, or such a request would wait forever",
            format_size(charge_bytes),
            format_size(request_bytes)
        ),
        LimitRule::AtMostOuterBytes { outer, outer_bytes } => format!(
            "must be at most limits.{outer} ({})",
            format_size(outer_bytes)
        ),
        other => other.to_string(),
    };
    Invalid::new(key, value, allowed)
}

/// `None` unless credentials are given; `tls.required` alone has nothing to require.
fn tls_config(t: &TlsSection) -> Result<Option<TlsConfig>, Invalid> {
    let required = t.required.unwrap_or(false);
    let legacy = t.legacy_cipher_suites.unwrap_or(false);
    let asked = t.psk_file.is_some()
        || t.cert_dir.is_some()
        || required
        || legacy
        || t.certificate_tenants.is_some()
        || t.handshakes_per_s_per_address.is_some();
    if !headroom_node::TLS_SUPPORTED && asked {
        return Err(Invalid::new(
            "tls",
            "",
            "this headroom was built without TLS; rebuild with --features tls \
             (cargo build --release -p headroom --features tls; needs libssl-dev and pkg-config)",
        ));
    }
    if t.psk_file.is_none() && t.cert_dir.is_none() {
        if required {
            return Err(Invalid::new(
                "tls.required",
                true,
                "needs tls.psk_file or tls.cert_dir (--tls-psk-file, --tls-cert-dir)",
            ));
        }
        if let Some(key) = [
            ("tls.legacy_cipher_suites", legacy),
            ("tls.certificate_tenants", t.certificate_tenants.is_some()),
            (
                "tls.handshakes_per_s_per_address",
                t.handshakes_per_s_per_address.is_some(),
            ),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key))
        {
            return Err(Invalid::new(
                key,
                "",
                "needs tls.psk_file or tls.cert_dir (--tls-psk-file, --tls-cert-dir)",
            ));
        }
        return Ok(None);
    }
    if let Some(map) = &t.certificate_tenants {
        for (cn, tenant) in map {
            if cn.is_empty() || cn.len() > 1024 {
                return Err(Invalid::new(
                    "tls.certificate_tenants",
                    cn,
                    "a certificate common name of 1 to 1024 bytes",
                ));
            }
            headroom_store::validate_tenant_id(tenant).map_err(|e| {
                Invalid::new(
                    "tls.certificate_tenants",
                    tenant,
                    format!("a tenant id for CN {cn:?} ({e})"),
                )
            })?;
        }
    }
    Ok(Some(TlsConfig {
        psk_file: t.psk_file.clone(),
        cert_dir: t.cert_dir.clone(),
        required,
        certificate_tenants: t.certificate_tenants.clone(),
        legacy_cipher_suites: legacy,
        handshakes_per_s_per_address: t
            .handshakes_per_s_per_address
            .unwrap_or(headroom_node::handshake_limit::DEFAULT_HANDSHAKES_PER_S_PER_ADDRESS),
    }))
}

fn qos_config(q: &QosSection) -> Result<QosConfig, Invalid> {
    let defaults = QosConfig::default();
    let workers = q.workers.unwrap_or(defaults.workers);
    let default_cpu = QosConfig::default_capacity(workers).per_second.cpu_ns;
    let c = &q.capacity;
    let capacity = CostVector::new(
        c.cpu_ns_per_s.unwrap_or(default_cpu),
        c.ingress_bytes_per_s.map_or(u64::MAX, |s| s.0),
        c.egress_bytes_per_s.map_or(u64::MAX, |s| s.0),
        c.device_units_per_s.unwrap_or(u64::MAX),
    );
    let workers_u64 = u64::try_from(workers).unwrap_or(u64::MAX);
    for (key, value) in [
        ("qos.capacity.cpu_ns_per_s", capacity.cpu_ns),
        ("qos.capacity.ingress_bytes_per_s", capacity.ingress_bytes),
        ("qos.capacity.egress_bytes_per_s", capacity.egress_bytes),
        ("qos.capacity.device_units_per_s", capacity.device_units),
    ] {
        if value < workers_u64 {
            return Err(Invalid::new(
                key,
                value,
                format!(
                    "must be at least qos.workers ({workers}): each worker gets 1/{workers} of it"
                ),
            ));
        }
    }
    let cpu_default = CpuModel::default();
    let cpu = CpuModel {
        read: q.cost.cpu.read.map_or(cpu_default.read, |l| l.line()),
        write: q.cost.cpu.write.map_or(cpu_default.write, |l| l.line()),
        other: q.cost.cpu.other.map_or(cpu_default.other, |l| l.line()),
        sync: q.cost.cpu.sync.map_or(cpu_default.sync, |l| l.line()),
    };
    let device = q
        .cost
        .device
        .as_ref()
        .map_or(DeviceModel::None, DeviceSection::model);
    let mut cost_model = CostModel::new(cpu, device);
    if q.cost.write_cost_aimd == Some(false) {
        // Neutral multiplier for good: never above 1x, never congested.
        cost_model.write_cost.max_permille = 1000;
        cost_model.write_cost.threshold_ns = u64::MAX;
    }
    Ok(QosConfig {
        policy: q.policy.unwrap_or(defaults.policy),
        params: q.params.params(),
        capacity: NodeCapacity::new(capacity),
        cost_model,
        workers,
        dispatch: q.dispatch.unwrap_or(defaults.dispatch),
        burst_in_flight: q.burst_in_flight.or(defaults.burst_in_flight),
        global_pool: q.global_pool.unwrap_or(defaults.global_pool),
    })
}

/// Settings that are allowed but probably not what was meant.
pub fn warnings(layer: &ConfigFile, config: &NodeConfig) -> Vec<String> {
    let mut out = Vec::new();
    if config.emulated_device.is_some()
        && config.qos.policy.kind().is_some()
        && layer.qos.cost.device.is_none()
    {
        out.push(
            "storage.emulated is set but qos.cost.device is not: the scheduler charges no device \
             cost, so it cannot share the emulated device (set qos.cost.device = { linear = ... } \
             to the same model)"
                .to_string(),
        );
    }
    if config.qos.cost_model.device == DeviceModel::None
        && layer.qos.capacity.device_units_per_s.is_some()
    {
        out.push(
            "qos.capacity.device_units_per_s is set but qos.cost.device is \"none\": requests \
             cost no device units, so it never binds"
                .to_string(),
        );
    }
    out
}

/// A configuration ready for `Node::start`, and where it came from.
#[derive(Debug)]
pub struct Loaded {
    pub node: NodeConfig,
    /// Fault injection to install on the store once it is open (`[faults]`).
    pub faults: Option<FaultConfig>,
    /// `--config`, if given.
    pub config_file: Option<PathBuf>,
    /// `DATA_DIR/calibration.toml`, if it was loaded.
    pub calibration_file: Option<PathBuf>,
    pub warnings: Vec<String>,
    /// Where the API token may come from (`token::server_token` decides).
    pub token: crate::token::TokenSettings,
}

/// Merges the command line over `--config` over the data directory's calibration file over
/// the defaults, and checks the result.
pub fn load(cli: ConfigFile, config_path: Option<&Path>) -> Result<Loaded> {
    let file = match config_path {
        Some(path) => ConfigFile::load(path)?,
        None => ConfigFile::default(),
    };
    let upper = cli.over(file);
    let data_dir = upper.data_dir();
    let calibration = data_dir.join(CALIBRATION_FILE);
    let same_as_config = config_path.is_some_and(|p| same_file(p, &calibration));
    let (merged, calibration_file) = if !same_as_config && calibration.is_file() {
        let lower = ConfigFile::load(&calibration)?;
        (upper.over(lower), Some(calibration))
    } else {
        (upper, None)
    };
    let sources = match (config_path, &calibration_file) {
        (Some(c), Some(k)) => format!("the command line, {} and {}", c.display(), k.display()),
        (Some(c), None) => format!("the command line and {}", c.display()),
        (None, Some(k)) => format!("the command line and {}", k.display()),
        (None, None) => "the command line".to_string(),
    };
    let node =
        resolve(&merged).with_context(|| format!("invalid configuration (from {sources})"))?;
    let faults = faults_config(&merged)
        .with_context(|| format!("invalid configuration (from {sources})"))?;
    let warnings = warnings(&merged, &node);
    // A memory node keeps its token in the data directory only when one was named.
    let token_dir = match &node.backend {
        StoreBackend::Files { data_dir, .. } | StoreBackend::Rados { data_dir, .. } => {
            Some(data_dir.clone())
        }
        StoreBackend::Memory { .. } => merged.storage.data_dir.clone(),
    };
    let mut node = node;
    if let Some(dir) = &token_dir {
        node.api_tokens_file = Some(dir.join(crate::token::TOKENS_FILE));
        node.audit_log = Some(dir.join(crate::token::AUDIT_LOG_FILE));
    }
    if let Some(path) = &merged.api.audit_log {
        node.audit_log = Some(path.clone());
    }
    let token = crate::token::TokenSettings {
        configured: merged.api.token.clone(),
        data_dir: token_dir,
    };
    Ok(Loaded {
        node,
        faults,
        config_file: config_path.map(Path::to_path_buf),
        calibration_file,
        warnings,
        token,
    })
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use headroom_qos::PolicyKind;

    fn parse(text: &str) -> Result<ConfigFile> {
        ConfigFile::parse(text, Path::new("test.toml"))
    }

    fn resolved(text: &str) -> NodeConfig {
        resolve(&parse(text).expect("parses")).expect("valid")
    }

    #[test]
    fn checksums_are_on_unless_storage_says_otherwise() {
        assert!(resolved("").checksums);
        assert!(!resolved("[storage]\nchecksums = false\n").checksums);
    }

    #[test]
    fn the_scrub_rate_and_interval_come_from_storage_scrub_and_are_checked() {
        let c = resolved("");
        assert_eq!(
            (c.scrub_rate_bytes_per_s, c.scrub_interval_s),
            (16 << 20, 7 * 24 * 3600)
        );
        let c = resolved("[storage.scrub]\nrate = \"32MiB\"\ninterval_s = 0\n");
        assert_eq!(
            (c.scrub_rate_bytes_per_s, c.scrub_interval_s),
            (32 << 20, 0)
        );
        assert!(err("[storage.scrub]\nrate = 0\n").contains("storage.scrub.rate"));
        assert!(err("[storage.scrub]\nrate = \"11GiB\"\n").contains("10GiB per second"));
        assert!(
            err("[storage.scrub]\ninterval_s = 31536001\n").contains("storage.scrub.interval_s")
        );
    }

    #[test]
    fn the_rebuild_rate_comes_from_storage_rebuild() {
        assert_eq!(resolved("").rebuild_rate_bytes_per_s, 64 << 20);
        let c = resolved("[storage.rebuild]\nrate = \"128MiB\"\n");
        assert_eq!(c.rebuild_rate_bytes_per_s, 128 << 20);
        assert_eq!(c.fail_device_after_errors, 16);
        let c = resolved("[storage.rebuild]\nfail_device_after_errors = 0\n");
        assert_eq!(c.fail_device_after_errors, 0);
        assert!(err("[storage.rebuild]\nspeed = 1\n").contains("speed"));
    }

    fn err(text: &str) -> String {
        match parse(text) {
            Err(e) => format!("{e:#}"),
            Ok(layer) => match resolve(&layer) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("accepted: {text}"),
            },
        }
    }

    #[test]
    fn empty_file_gives_the_built_in_defaults() {
        let c = resolved("");
        let d = NodeConfig::new(StoreBackend::Memory { capacity_bytes: 1 });
        assert!(matches!(
            &c.backend,
            StoreBackend::Files { data_dir, device_count: 2, device_capacity_bytes, device_paths }
                if data_dir == Path::new(DEFAULT_DATA_DIR)
                    && *device_capacity_bytes == 64 << 30
                    && device_paths.is_empty()
        ));
        assert_eq!(c.nbd_listen, d.nbd_listen);
        assert_eq!(c.api_listen, d.api_listen);
        assert_eq!(c.io_threads, d.io_threads);
        assert_eq!(c.inline_max_bytes, None);
        assert_eq!(c.coalesce_us, None);
        assert_eq!(c.qos, QosConfig::default());
        assert_eq!(c.credit_save_period_ms, d.credit_save_period_ms);
        assert_eq!(c.emulated_device, None);
        let l = Limits::default();
        assert_eq!(c.limits.max_connections, l.max_connections);
        assert_eq!(c.limits.max_request_bytes, l.max_request_bytes);
        assert_eq!(
            c.limits.max_inflight_bytes_per_conn,
            l.max_inflight_bytes_per_conn
        );
    }

    #[test]
    fn coalescing_is_on_by_default_for_memory_and_off_for_files() {
        let memory = resolved("[storage]\nmemory = \"1GiB\"");
        assert_eq!(
            memory.effective_coalesce_us(),
            headroom_node::config::DEFAULT_COALESCE_US
        );
        assert_eq!(resolved("").effective_coalesce_us(), 0);
        let files_on = resolved("[server]\ncoalesce_us = 7");
        assert_eq!(files_on.effective_coalesce_us(), 7);
        let memory_off = resolved("[server]\ncoalesce_us = 0\n[storage]\nmemory = \"1GiB\"");
        assert_eq!(memory_off.effective_coalesce_us(), 0);
    }

    #[test]
    fn every_key_reaches_the_node_config() {
        let c = resolved(
            r#"
            [server]
            nbd_listen = "127.0.0.1:1"
            api_listen = "127.0.0.1:2"
            io_threads = 3
            inline_max_bytes = "16KiB"
            coalesce_us = 35
            net_threads = 3
            [storage]
            memory = "1GiB"
            [storage.emulated]
            parallelism = 4
            write_interference_permille = 500
            [storage.emulated.model]
            rbps = "200MB"
            rseqiops = 48828
            rrandiops = 20000
            wbps = 100000000
            wseqiops = 20000
            wrandiops = 10000
            [limits]
            max_connections = 7
            max_connections_per_ip = 3
            max_inflight_requests = 8
            max_inflight_bytes = "64MiB"
            max_inflight_bytes_per_tenant = "96MiB"
            max_inflight_bytes_per_node = "2GiB"
            max_request_bytes = "1MiB"
            handshake_timeout_ms = 900
            client_stall_timeout_ms = 1500
            [qos]
            policy = "drr-vop"
            workers = 4
            dispatch = "stealing"
            credit_save_period_ms = 250
            [qos.capacity]
            cpu_ns_per_s = 3_000_000_000
            ingress_bytes_per_s = "1GB"
            egress_bytes_per_s = 2_000_000_000
            device_units_per_s = 1_000_000_000
            [qos.params]
            window_ns = 5_000_000
            limiter_depth_ns = 1_000_000
            history_windows = 4
            alpha_permille = 1500
            throttle_weight_permille = 2000
            reserve_permille = 100
            drr_quantum_device_units = 5000
            seed = 42
            track_invariants = true
            reorder_lookahead = 4
            [qos.cost]
            cpu = { read = { base_ns = 1000, per_kib_ps = 50000 }, write = { base_ns = 2000, per_kib_ps = 60000 }, other = { base_ns = 500, per_kib_ps = 0 } }
            device = { linear = { rbps = 1, rseqiops = 2, rrandiops = 3, wbps = 4, wseqiops = 5, wrandiops = 6 } }
            "#,
        );
        assert!(
            matches!(c.backend, StoreBackend::Memory { capacity_bytes } if capacity_bytes == 1 << 30)
        );
        assert_eq!(c.nbd_listen, "127.0.0.1:1".parse::<SocketAddr>().unwrap());
        assert_eq!(c.api_listen, "127.0.0.1:2".parse::<SocketAddr>().unwrap());
        assert_eq!(c.io_threads, 3);
        assert_eq!(c.inline_max_bytes, Some(16 << 10));
        assert_eq!(c.coalesce_us, Some(35));
        assert_eq!(c.net_threads, Some(3));
        assert_eq!(c.effective_net_threads(), 3);
        let e = c.emulated_device.expect("emulated device");
        assert_eq!(e.parallelism, 4);
        assert_eq!(e.write_interference_permille, 500);
        assert_eq!(e.model.rbps, 200_000_000);
        assert_eq!(e.model.wrandiops, 10_000);
        assert_eq!(c.limits.max_connections, 7);
        assert_eq!(c.limits.max_inflight_requests_per_conn, 8);
        assert_eq!(c.limits.max_inflight_bytes_per_conn, 64 << 20);
        assert_eq!(c.limits.max_request_bytes, 1 << 20);
        assert_eq!(c.limits.handshake_timeout_ms, 900);
        assert_eq!(c.limits.max_connections_per_ip, 3);
        assert_eq!(c.limits.max_inflight_bytes_per_tenant, 96 << 20);
        assert_eq!(c.limits.max_inflight_bytes_per_node, 2 << 30);
        assert_eq!(c.limits.client_stall_timeout_ms, 1500);
        assert_eq!(c.credit_save_period_ms, 250);
        let q = &c.qos;
        assert_eq!(q.policy, PolicyChoice::Policy(PolicyKind::DrrVop));
        assert_eq!(q.workers, 4);
        assert_eq!(q.dispatch, DispatchMode::Stealing);
        assert_eq!(
            q.capacity.per_second,
            CostVector::new(3_000_000_000, 1_000_000_000, 2_000_000_000, 1_000_000_000)
        );
        assert_eq!(
            q.params,
            PolicyParams {
                window_ns: 5_000_000,
                limiter_depth_ns: 1_000_000,
                history_windows: 4,
                alpha_permille: 1500,
                throttle_weight_permille: 2000,
                reserve_permille: 100,
                drr_quantum_device_units: 5000,
                seed: 42,
                track_invariants: true,
                reorder_lookahead: 4,
                pacer_depth_ns: QosConfig::server_params().pacer_depth_ns,
            }
        );
        assert_eq!(
            q.cost_model.cpu.read,
            LinearCpu {
                base_ns: 1000,
                per_kib_ps: 50_000
            }
        );
        assert_eq!(
            q.cost_model.cpu.write,
            LinearCpu {
                base_ns: 2000,
                per_kib_ps: 60_000
            }
        );
        assert_eq!(
            q.cost_model.cpu.other,
            LinearCpu {
                base_ns: 500,
                per_kib_ps: 0
            }
        );
        assert_eq!(
            q.cost_model.device,
            DeviceModel::Linear(IoCostModel {
                rbps: 1,
                rseqiops: 2,
                rrandiops: 3,
                wbps: 4,
                wseqiops: 5,
                wrandiops: 6
            })
        );
    }

    #[test]
    fn files_backend_keys() {
        let c = resolved(
            r#"
            [storage]
            data_dir = "/srv/headroom"
            devices = 3
            device_size = "8GiB"
            device_paths = ["/dev/a", "/dev/b"]
            "#,
        );
        match c.backend {
            StoreBackend::Files {
                data_dir,
                device_count,
                device_capacity_bytes,
                device_paths,
            } => {
                assert_eq!(data_dir, Path::new("/srv/headroom"));
                assert_eq!(device_count, 3);
                assert_eq!(device_capacity_bytes, 8 << 30);
                assert_eq!(
                    device_paths,
                    vec![PathBuf::from("/dev/a"), PathBuf::from("/dev/b")]
                );
            }
            other => panic!("{other:?}"),
        }
        // Without a calibration the CPU capacity follows the workers.
        let c = resolved("[qos]\nworkers = 5\n");
        assert_eq!(c.qos.capacity, QosConfig::default_capacity(5));
        // Tracked in debug builds (this test's), never in release.
        assert_eq!(c.qos.params.track_invariants, cfg!(debug_assertions));
    }

    #[test]
    fn vop_curve_and_none_device() {
        let c = resolved(
            r#"
            [qos.cost.device.vop]
            read = [["4KiB", 80000], ["64KiB", 20000], [1048576, 2000]]
            write = [["4KiB", 60000]]
            "#,
        );
        let DeviceModel::Vop(curve) = c.qos.cost_model.device else {
            panic!("not a VOP curve")
        };
        assert_eq!(curve.max_iops, 80_000);
        assert_eq!(
            curve.read,
            vec![(4096, 80_000), (65_536, 20_000), (1 << 20, 2000)]
        );
        assert_eq!(curve.write, vec![(4096, 60_000)]);
        let c = resolved("[qos.cost]\ndevice = \"none\"\n");
        assert_eq!(c.qos.cost_model.device, DeviceModel::None);
    }

    #[test]
    fn emulated_device_with_a_curve() {
        let c = resolved(
            r#"
            [storage]
            memory = "1GiB"
            [storage.emulated]
            parallelism = 8
            curve = { read = [["4KiB", 90000], ["256KiB", 2600]], write = [["4KiB", 34000], ["256KiB", 1050]] }
            [qos.cost]
            device = { vop = { read = [["4KiB", 90000], ["256KiB", 2600]], write = [["4KiB", 34000], ["256KiB", 1050]] } }
            [qos.capacity]
            device_units_per_s = 90_000_000
            "#,
        );
        let curve = c.emulated_curve.expect("a curve");
        assert_eq!(curve.max_iops, 90_000);
        assert_eq!(curve.read, vec![(4096, 90_000), (256 << 10, 2600)]);
        let spec = c.emulated_device.expect("a device");
        assert_eq!(spec.parallelism, 8);
        assert_eq!(spec.model.rrandiops, 90_000);
        assert_eq!(spec.model.wbps, (256 << 10) * 1050);
        assert_eq!(c.qos.cost_model.device, DeviceModel::Vop(curve));
        // Without a curve: none.
        let c = resolved(
            "[storage.emulated]\nparallelism = 1\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1\n[qos.cost]\ndevice = \"none\"\n",
        );
        assert!(c.emulated_curve.is_none());
        // Both, neither, or a bad curve: the key and the reason.
        let both = err(
            "[storage.emulated]\nparallelism = 1\ncurve = { read = [[4096, 1]], write = [[4096, 1]] }\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
        );
        assert!(
            both.contains("storage.emulated.curve") && both.contains("not both"),
            "{both}"
        );
        let neither = err("[storage.emulated]\nparallelism = 1\n");
        assert!(
            neither.contains("storage.emulated.model") && neither.contains("curve"),
            "{neither}"
        );
        let bad = err(
            "[storage.emulated]\nparallelism = 1\ncurve = { read = [[8192, 1], [4096, 2]], write = [[4096, 1]] }\n",
        );
        assert!(
            bad.contains("storage.emulated.curve.read") && bad.contains("increasing"),
            "{bad}"
        );
    }

    #[test]
    fn write_cost_aimd_can_be_turned_off() {
        let congested = |text: &str| {
            let mut m = resolved(text).qos.cost_model;
            let before = m.estimate(headroom_qos::OpKind::Write, 4096, false);
            for _ in 0..10 {
                m.observe(
                    headroom_qos::OpKind::Write,
                    4096,
                    false,
                    &before,
                    headroom_qos::Observed {
                        service_ns: 50_000_000,
                        queue_ns: 0,
                    },
                );
            }
            let after = m.estimate(headroom_qos::OpKind::Write, 4096, false);
            (before.device_units, after.device_units)
        };
        let device = "[qos.cost]\ndevice = { linear = { rbps = 200000000, rseqiops = 48828, rrandiops = 20000, wbps = 150000000, wseqiops = 36621, wrandiops = 15000 } }\n";
        // On by default: 50 ms writes raise the write cost toward 3.4x.
        let (before, after) = congested(device);
        assert!(after > 3 * before, "{before} -> {after}");
        let (before, after) = congested(&format!("{device}write_cost_aimd = false\n"));
        assert_eq!(before, after);
        let (before, after) = congested(&format!("{device}write_cost_aimd = true\n"));
        assert!(after > 3 * before, "{before} -> {after}");
    }

    #[test]
    fn out_of_range_values_name_key_value_and_what_is_allowed() {
        let cases = [
            (
                "[qos]\nworkers = 0",
                "qos.workers = 0: must be between 1 and 64",
            ),
            (
                "[qos]\nworkers = 65",
                "qos.workers = 65: must be between 1 and 64",
            ),
            (
                "[qos]\npolicy = \"fast\"",
                "qos.policy = \"fast\": expected off, wild, base, credit, burst, mclock or drr-vop",
            ),
            (
                "[qos]\ndispatch = \"random\"",
                "qos.dispatch = \"random\": expected one-to-n",
            ),
            (
                "[qos.capacity]\ncpu_ns_per_s = 0",
                "qos.capacity.cpu_ns_per_s = 0: must be greater than 0",
            ),
            (
                "[qos]\nworkers = 8\n[qos.capacity]\ndevice_units_per_s = 4",
                "qos.capacity.device_units_per_s = 4: must be at least qos.workers (8)",
            ),
            (
                "[qos.params]\nwindow_ns = 5",
                "qos.params: invalid policy parameters: window_ns 5",
            ),
            (
                "[qos.params]\nreserve_permille = 600",
                "reserve_permille 600 must be < 500",
            ),
            (
                "[server]\nio_threads = 1000",
                "server.io_threads = 1000: must be between 0 (inline) and 256",
            ),
            (
                "[server]\ncoalesce_us = 5000",
                "server.coalesce_us = 5000: must be between 0 (off) and 1000",
            ),
            (
                "[server]\nnet_threads = 257",
                "server.net_threads = 257: must be between 0 (connections on the shared runtime) and 256",
            ),
            (
                "[server]\ninline_max_bytes = \"8GiB\"",
                "server.inline_max_bytes = \"8GiB\": must be less than 4GiB",
            ),
            (
                "[storage]\nmemory = 0",
                "storage.memory = 0: must be greater than 0",
            ),
            (
                "[storage]\ndevices = 0",
                "storage.devices = 0: must be at least 1",
            ),
            (
                "[storage]\nmemory = \"1GiB\"\nmetadata_reserve = \"64MiB\"",
                "storage.metadata_reserve = \"64MiB\": a RAM store keeps no metadata on disk",
            ),
            (
                "[storage]\nmetadata_reserve = \"65GiB\"",
                "storage.metadata_reserve = \"65GiB\": must be at most 64GiB",
            ),
            ("[storage]\nmemory = \"4XB\"", "invalid size \"4XB\""),
            (
                "[limits]\nmax_connections = 0",
                "limits.max_connections = 0: must be at least 1",
            ),
            (
                "[limits]\nmax_inflight_requests = 0",
                "limits.max_inflight_requests = 0: must be at least 1",
            ),
            (
                "[limits]\nmax_request_bytes = \"64MiB\"",
                "limits.max_request_bytes = \"64MiB\": must be between 4KiB and 32MiB",
            ),
            (
                "[limits]\nmax_inflight_bytes = \"16MiB\"",
                "limits.max_inflight_bytes = \"16MiB\": must be at least 32MiB, the buffer a request \
                 of limits.max_request_bytes (32MiB) occupies, or such a request would wait forever",
            ),
            (
                "[limits]\nmax_request_bytes = \"20MiB\"\nmax_inflight_bytes = \"24MiB\"",
                "limits.max_inflight_bytes = \"24MiB\": must be at least 32MiB, the buffer a request \
                 of limits.max_request_bytes (20MiB) occupies, or such a request would wait forever",
            ),
            (
                "[limits]\nmax_inflight_bytes_per_node = \"16MiB\"",
                "limits.max_inflight_bytes_per_node = \"16MiB\": must be at least 32MiB, the buffer a \
                 request of limits.max_request_bytes (32MiB) occupies, or such a request would wait \
                 forever",
            ),
            (
                "[limits]\nmax_inflight_bytes_per_tenant = \"64MiB\"",
                "limits.max_inflight_bytes = \"128MiB\": must be at most \
                 limits.max_inflight_bytes_per_tenant (64MiB)",
            ),
            (
                "[limits]\nmax_inflight_bytes_per_node = \"64MiB\"\nmax_inflight_bytes = \"32MiB\"",
                "limits.max_inflight_bytes_per_tenant = \"256MiB\": must be at most \
                 limits.max_inflight_bytes_per_node (64MiB)",
            ),
            (
                "[limits]\nmax_connections = 4\nmax_connections_per_ip = 5",
                "limits.max_connections_per_ip = 5: must be between 1 and limits.max_connections (4)",
            ),
            (
                "[limits]\nipv6_prefix_len = 0",
                "limits.ipv6_prefix_len = 0: must be between 1 and 128",
            ),
            (
                "[limits]\nmax_connections_per_ip = 0",
                "limits.max_connections_per_ip = 0: must be at least 1",
            ),
            (
                "[limits]\nmax_inflight_requests = 70000",
                "limits.max_inflight_requests = 70000: must be between 1 and 65536",
            ),
            (
                "[limits]\nclient_stall_timeout_ms = 0",
                "limits.client_stall_timeout_ms = 0: must be at least 1",
            ),
            (
                "[limits]\nhandshake_timeout_ms = 3600001",
                "limits.handshake_timeout_ms = 3600001: must be between 1 and 3600000",
            ),
            (
                "[limits]\nhandshake_timeout_ms = 0",
                "limits.handshake_timeout_ms = 0: must be at least 1",
            ),
            (
                "[storage.emulated]\nparallelism = 0\n[storage.emulated.model]\nrbps = 1\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
                "storage.emulated.parallelism = 0: must be between 1 and 1024",
            ),
            (
                "[storage.emulated]\nparallelism = 1\n[storage.emulated.model]\nrbps = 0\nrseqiops = 1\nrrandiops = 1\nwbps = 1\nwseqiops = 1\nwrandiops = 1",
                "storage.emulated.model.rbps = 0",
            ),
            (
                "[qos.cost]\ndevice = { linear = { rbps = 1, rseqiops = 0, rrandiops = 1, wbps = 1, wseqiops = 1, wrandiops = 1 } }",
                "qos.cost.device.linear.rseqiops = 0: every rate must be greater than 0",
            ),
            (
                "[qos.cost.device.vop]\nread = [[8192, 5], [4096, 6]]\nwrite = [[4096, 1]]",
                "qos.cost.device.vop.read = [4096, 6]: sizes must be greater than 0 and increasing",
            ),
            (
                "[qos.cost.device.vop]\nread = []\nwrite = [[4096, 1]]",
                "qos.cost.device.vop.read = []: needs at least one",
            ),
            ("[qos.cost]\ndevice = \"fast\"", "unknown variant `fast`"),
            (
                "[qos.cost.cpu]\nread = { base_ns = 2000000000, per_kib_ps = 0 }",
                "qos.cost.cpu.read.base_ns = 2000000000: must be at most",
            ),
        ];
        for (text, want) in cases {
            let got = err(text);
            assert!(
                got.contains(want),
                "config {text:?}\n  error: {got}\n  wanted: {want}"
            );
        }
    }

    #[test]
    fn unknown_keys_are_named_with_the_file_and_line() {
        for (text, key, line) in [
            ("[qos]\nwrkers = 2\n", "wrkers", "line 2"),
            ("[server]\nio_threads = 2\n\n[sever]\n", "sever", "line 4"),
            (
                "[storage.emulated]\nparallelism = 1\nparalelism = 2\n",
                "paralelism",
                "line 3",
            ),
            ("[qos.params]\nwindow = 1\n", "window", "line 2"),
            (
                "[qos.cost]\ncpu = { read = { base = 1, per_kib_ps = 2 } }\n",
                "base",
                "line 2",
            ),
        ] {
            let got = err(text);
            assert!(
                got.contains("test.toml") && got.contains(key) && got.contains(line),
                "config {text:?}: {got}"
            );
        }
    }

    #[test]
    fn higher_layers_win_key_by_key() {
        let cli = ConfigFile {
            qos: QosSection {
                policy: Some(PolicyChoice::Off),
                ..QosSection::default()
            },
            ..ConfigFile::default()
        };
        let file = parse(
            "[qos]\npolicy = \"mclock\"\nworkers = 3\n[server]\nio_threads = 1\n[qos.params]\nseed = 9\n",
        )
        .unwrap();
        let calibration = parse(
            "[qos]\nworkers = 7\n[qos.params]\nwindow_ns = 2000000\nseed = 1\n[qos.capacity]\ncpu_ns_per_s = 8000000000\n",
        )
        .unwrap();
        let c = resolve(&cli.over(file).over(calibration)).unwrap();
        assert_eq!(c.qos.policy, PolicyChoice::Off);
        assert_eq!(c.qos.workers, 3);
        assert_eq!(c.io_threads, 1);
        assert_eq!(c.qos.params.seed, 9);
        assert_eq!(c.qos.params.window_ns, 2_000_000);
        assert_eq!(c.qos.capacity.per_second.cpu_ns, 8_000_000_000);
    }

    #[test]
    fn device_capacity_follows_the_layer_that_picks_the_device_model() {
        let calibration = parse(
            "[qos.capacity]\ndevice_units_per_s = 90000000\n[qos.cost.device.vop]\nread = [[4096, 90000]]\nwrite = [[4096, 80000]]\n",
        )
        .unwrap();
        // A file that picks a linear model without a capacity: the VOP capacity is dropped.
        let linear = parse(
            "[qos.cost]\ndevice = { linear = { rbps = 1, rseqiops = 1, rrandiops = 1, wbps = 1, wseqiops = 1, wrandiops = 1 } }\n",
        )
        .unwrap();
        let c = resolve(&linear.over(calibration.clone())).unwrap();
        assert!(matches!(c.qos.cost_model.device, DeviceModel::Linear(_)));
        assert_eq!(c.qos.capacity.per_second.device_units, u64::MAX);
        // A file that only sets other keys keeps the calibrated pair.
        let other = parse("[qos]\nworkers = 2\n").unwrap();
        let c = resolve(&other.over(calibration)).unwrap();
        assert!(matches!(c.qos.cost_model.device, DeviceModel::Vop(_)));
        assert_eq!(c.qos.capacity.per_second.device_units, 90_000_000);
    }

    #[test]
    fn calibration_in_the_data_dir_is_loaded_under_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(CALIBRATION_FILE),
            "[qos]\npolicy = \"mclock\"\nworkers = 3\n",
        )
        .unwrap();
        let config = dir.path().join("node.toml");
        std::fs::write(
            &config,
            "[qos]\nworkers = 4\n[storage]\nmemory = \"1GiB\"\n",
        )
        .unwrap();
        let cli = ConfigFile {
            storage: StorageSection {
                data_dir: Some(dir.path().to_path_buf()),
                ..StorageSection::default()
            },
            ..ConfigFile::default()
        };
        let loaded = load(cli.clone(), Some(&config)).unwrap();
        assert_eq!(
            loaded.calibration_file,
            Some(dir.path().join(CALIBRATION_FILE))
        );
        assert_eq!(
            loaded.node.qos.policy,
            PolicyChoice::Policy(PolicyKind::MClock)
        );
        assert_eq!(loaded.node.qos.workers, 4);
        // Without one: the defaults.
        let empty = tempfile::tempdir().unwrap();
        let cli = ConfigFile {
            storage: StorageSection {
                data_dir: Some(empty.path().to_path_buf()),
                memory: Some(Size(1 << 30)),
                ..StorageSection::default()
            },
            ..ConfigFile::default()
        };
        let loaded = load(cli, None).unwrap();
        assert_eq!(loaded.calibration_file, None);
        assert_eq!(loaded.node.qos, QosConfig::default());
        // Errors in the calibration file name it.
        std::fs::write(dir.path().join(CALIBRATION_FILE), "[qos]\nworkers = 0\n").unwrap();
        let got = format!(
            "{:#}",
            load(
                ConfigFile::default().over(ConfigFile {
                    storage: StorageSection {
                        data_dir: Some(dir.path().to_path_buf()),
                        ..StorageSection::default()
                    },
                    ..ConfigFile::default()
                }),
                None
            )
            .unwrap_err()
        );
        assert!(
            got.contains(CALIBRATION_FILE) && got.contains("qos.workers = 0"),
            "{got}"
        );
    }

    #[test]
    fn device_admission_keys_are_checked_and_reach_the_node() {
        let path = Path::new("node.toml");
        for (bad, key) in [
            ("device_dirs = [\"relative/dir\"]\n", "storage.device_dirs"),
            ("block_devices = [\"sdb\"]\n", "storage.block_devices"),
            ("max_device_bytes = \"1MiB\"\n", "storage.max_device_bytes"),
            ("max_volume_bytes = \"65TiB\"\n", "storage.max_volume_bytes"),
            ("max_volume_bytes = 0\n", "storage.max_volume_bytes"),
        ] {
            let err = ConfigFile::parse(&format!("[storage]\n{bad}"), path)
                .and_then(|layer| resolve(&layer).map(|_| ()).map_err(Into::into))
                .map(|_| String::new())
                .unwrap_or_else(|e| format!("{e:#}"));
            assert!(err.contains(key), "{bad}: {err:?}");
        }
        let layer = ConfigFile::parse(
            "[storage]\ndevice_dirs = [\"/srv/d\"]\nblock_devices = [\"/dev/loop9\"]\n\
             max_device_bytes = \"1TiB\"\nmax_volume_bytes = \"2TiB\"\n",
            path,
        )
        .unwrap();
        let policy = resolve(&layer).unwrap().device_admission;
        assert_eq!(policy.device_dirs, vec![PathBuf::from("/srv/d")]);
        assert_eq!(policy.block_devices, vec![PathBuf::from("/dev/loop9")]);
        assert_eq!(
            (policy.max_device_bytes, policy.max_volume_bytes),
            (1 << 40, 2 << 40)
        );
        let defaults = resolve(&ConfigFile::default()).unwrap().device_admission;
        assert_eq!(defaults, headroom_store::AdmissionPolicy::default());
    }

    #[test]
    fn the_overcommit_ratio_is_at_least_one_and_reaches_the_node() {
        let path = Path::new("node.toml");
        for bad in ["0.5", "-1.0", "nan", "inf"] {
            let err = format!(
                "{:#}",
                ConfigFile::parse(&format!("[storage]\novercommit_ratio = {bad}\n"), path)
                    .unwrap_err()
            );
            assert!(err.contains("storage.overcommit_ratio"), "{bad}: {err}");
        }
        let layer = ConfigFile::parse("[storage]\nmemory = \"1GiB\"\novercommit_ratio = 3\n", path)
            .unwrap();
        assert_eq!(resolve(&layer).unwrap().overcommit_ratio, Some(3.0));
        let none = ConfigFile::parse("[storage]\nmemory = \"1GiB\"\n", path).unwrap();
        assert_eq!(resolve(&none).unwrap().overcommit_ratio, None);
    }

    #[test]
    fn the_api_token_is_checked_merged_and_never_shown() {
        let path = Path::new("node.toml");
        let err = format!(
            "{:#}",
            ConfigFile::parse("[api]\ntoken = \"short\"\n", path).unwrap_err()
        );
        assert!(err.contains("api.token") && !err.contains("short"), "{err}");
        let file = ConfigFile::parse("[api]\ntoken = \"0123456789abcdef0123\"\n", path).unwrap();
        let merged = ConfigFile::default().over(file);
        assert_eq!(merged.api.token.as_deref(), Some("0123456789abcdef0123"));
        assert!(!format!("{merged:?}").contains("0123456789abcdef0123"));
    }

    #[test]
    fn the_documented_example_parses_and_shows_the_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let section = doc
            .split("## Configuration file")
            .nth(1)
            .expect("a Configuration file section");
        let block = section
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a toml block");
        let config = ConfigFile::parse(block, &path).unwrap();
        let config = if headroom_node::TLS_SUPPORTED {
            config
        } else {
            // A build without TLS refuses the example's [tls] section by name; the rest of
            // the example must still hold.
            let err = resolve(&config).expect_err("[tls] without the tls feature");
            assert_eq!(err.key, "tls", "{err:?}");
            ConfigFile {
                tls: TlsSection::default(),
                ..config
            }
        };
        let c = resolve(&config).unwrap();
        // The values it shows as defaults are the defaults (a release build's: a debug build
        // tracks the invariants unless told not to, and the example says `false`).
        assert_eq!(
            c.qos.params,
            PolicyParams {
                track_invariants: false,
                ..QosConfig::server_params()
            }
        );
        assert_eq!(c.qos.workers, QosConfig::default().workers);
        assert_eq!(c.qos.capacity.per_second.cpu_ns, 2 * NS_PER_S);
        let l = Limits::default();
        assert_eq!(c.limits.max_connections, l.max_connections);
        assert_eq!(
            c.limits.max_inflight_requests_per_conn,
            l.max_inflight_requests_per_conn
        );
        assert_eq!(
            c.limits.max_inflight_bytes_per_conn,
            l.max_inflight_bytes_per_conn
        );
        assert_eq!(c.limits.max_request_bytes, l.max_request_bytes);
        assert_eq!(c.limits.handshake_timeout_ms, l.handshake_timeout_ms);
        assert_eq!(c.limits.max_connections_per_ip, l.max_connections_per_ip);
        assert_eq!(
            c.limits.max_inflight_bytes_per_tenant,
            l.max_inflight_bytes_per_tenant
        );
        assert_eq!(
            c.limits.max_inflight_bytes_per_node,
            l.max_inflight_bytes_per_node
        );
        assert_eq!(c.limits.client_stall_timeout_ms, l.client_stall_timeout_ms);
        assert_eq!(c.credit_save_period_ms, 1_000);
        assert_eq!(c.io_threads, 2);
    }

    #[test]
    fn the_interference_example_parses_and_validates() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/interference-node.toml");
        let layer = ConfigFile::load(&path).unwrap();
        let c = resolve(&layer).unwrap();
        assert!(
            warnings(&layer, &c).is_empty(),
            "{:?}",
            warnings(&layer, &c)
        );
        assert_eq!(c.qos.policy, PolicyChoice::Policy(PolicyKind::Burst));
        assert!(
            matches!(c.backend, StoreBackend::Memory { capacity_bytes } if capacity_bytes == 4 << 30)
        );
        let spec = c.emulated_device.expect("an emulated device");
        // The scheduler knows the device exactly: same model, one device of 10⁹ device-ns/s.
        assert_eq!(c.qos.cost_model.device, DeviceModel::Linear(spec.model));
        assert_eq!(c.qos.capacity.per_second.device_units, NS_PER_S);
        // Well below what this machine does unthrottled (~40–80k 4 KiB IOPS).
        let r4 = spec.cost_ns(headroom_qos::OpKind::Read, 4096, false);
        assert_eq!(NS_PER_S / r4, 20_000);
    }

    #[test]
    fn tls_keys_reach_the_node_config_or_ask_for_the_feature() {
        let text = "[tls]\npsk_file = \"keys.psk\"\ncert_dir = \"pki\"\nrequired = true\n";
        let result = resolve(&parse(text).unwrap());
        if headroom_node::TLS_SUPPORTED {
            let tls = result.unwrap().tls.unwrap();
            assert_eq!(tls.psk_file, Some(PathBuf::from("keys.psk")));
            assert_eq!(tls.cert_dir, Some(PathBuf::from("pki")));
            assert!(tls.required);
            assert!(!tls.legacy_cipher_suites);
            assert_eq!(tls.handshakes_per_s_per_address, 100);
            assert_eq!(tls.certificate_tenants, None);
            assert!(err("[tls]\nrequired = true\n").contains("needs tls.psk_file"));
            let mapped = resolved(
                "[tls]\ncert_dir = \"pki\"\nlegacy_cipher_suites = true\n\
                 handshakes_per_s_per_address = 0\n\
                 [tls.certificate_tenants]\n\"host-1.example\" = \"alice\"\n",
            )
            .tls
            .unwrap();
            assert!(mapped.legacy_cipher_suites);
            assert_eq!(mapped.handshakes_per_s_per_address, 0);
            assert_eq!(
                mapped.certificate_tenants,
                Some([("host-1.example".to_string(), "alice".to_string())].into())
            );
            for (bad, says) in [
                (
                    "[tls]\nlegacy_cipher_suites = true\n",
                    "tls.legacy_cipher_suites",
                ),
                (
                    "[tls.certificate_tenants]\n\"h\" = \"alice\"\n",
                    "tls.certificate_tenants",
                ),
                (
                    "[tls]\ncert_dir = \"pki\"\n[tls.certificate_tenants]\n\"h\" = \" alice\"\n",
                    "a tenant id for CN \"h\"",
                ),
                (
                    "[tls]\ncert_dir = \"pki\"\n[tls.certificate_tenants]\n\"\" = \"alice\"\n",
                    "a certificate common name of 1 to 1024 bytes",
                ),
            ] {
                let text = err(bad);
                assert!(text.contains(says), "{bad}: {text}");
            }
        } else {
            let err = result.unwrap_err().to_string();
            assert!(
                err.contains("built without TLS; rebuild with --features tls"),
                "{err}"
            );
        }
        assert_eq!(resolved("[tls]\nrequired = false\n").tls, None);
        assert_eq!(resolved("").tls, None);
    }

    #[test]
    fn rados_keys_select_the_backend_or_ask_for_the_feature() {
        let text = "[storage]\ndata_dir = \"/srv/h\"\nrados_conf = \"/etc/ceph/ceph.conf\"\n\
                    rados_pool = \"volumes\"\ndevice_size = \"1TiB\"\n";
        let result = resolve(&parse(text).unwrap());
        if headroom_store::RADOS_SUPPORTED {
            let config = result.unwrap();
            assert!(
                matches!(&config.backend, StoreBackend::Rados { data_dir, conf, id, pool, capacity_bytes, .. }
                    if data_dir == Path::new("/srv/h")
                        && conf == Path::new("/etc/ceph/ceph.conf")
                        && id == "admin"
                        && pool == "volumes"
                        && *capacity_bytes == 1 << 40),
                "{:?}",
                config.backend
            );
            for (extra, key) in [
                ("memory = \"1GiB\"\n", "storage.memory"),
                ("devices = 2\n", "storage.devices"),
                ("device_paths = [\"/dev/sdb\"]\n", "storage.device_paths"),
            ] {
                let e = err(&format!("{text}{extra}"));
                assert!(e.contains(&format!("leave out {key}")), "{e}");
            }
        } else {
            let e = result.unwrap_err().to_string();
            assert!(
                e.contains("built without the RADOS backend; rebuild with --features rados"),
                "{e}"
            );
        }
        let e = err("[storage]\nrados_pool = \"p\"\n");
        assert!(
            e.contains("storage.rados_pool") && e.contains("needs storage.rados_conf"),
            "{e}"
        );
        let e = err("[storage]\nrados_conf = \"c\"\n");
        assert!(
            e.contains("storage.rados_conf") && e.contains("needs storage.rados_pool"),
            "{e}"
        );
        assert!(err("[storage]\nrados_pool = \"a/b\"\n").contains("must be a pool name"));
        let e = err(&format!("{text}rados_lease_lost_linger_ms = 600001\n"));
        assert!(
            e.contains("storage.rados_lease_lost_linger_ms") && e.contains("at most 600000"),
            "{e}"
        );
        let e = err("[storage]\nrados_lease_lost_linger_ms = 1\n");
        assert!(e.contains("needs storage.rados_pool"), "{e}");
        let e = err("[storage]\nrados_id = \"headroom\"\n");
        assert!(
            e.contains("storage.rados_id") && e.contains("needs storage.rados_pool"),
            "{e}"
        );
        for (bad, why) in [
            ("", "must not be empty"),
            ("client.headroom", "without the `client.` prefix"),
            ("a b", "only ASCII letters"),
        ] {
            let e = err(&format!("{text}rados_id = {bad:?}\n"));
            assert!(e.contains("storage.rados_id") && e.contains(why), "{e}");
        }
        if headroom_store::RADOS_SUPPORTED {
            let config =
                resolve(&parse(&format!("{text}rados_id = \"headroom\"\n")).unwrap()).unwrap();
            assert!(
                matches!(&config.backend, StoreBackend::Rados { id, .. } if id == "headroom"),
                "{:?}",
                config.backend
            );
        }
    }

    fn faults(text: &str) -> Result<Option<FaultConfig>, String> {
        let layer = parse(text).map_err(|e| format!("{e:#}"))?;
        faults_config(&layer).map_err(|e| e.to_string())
    }

    #[test]
    fn latency_spikes_turn_inline_execution_off_unless_it_was_chosen() {
        let spikes = "[storage]\nmemory = \"1GiB\"\n[[faults.rule]]\nvolume = \"v\"\n\
                      latency_spike_permille = 5\nlatency_spike_ms = 20\n";
        assert_eq!(resolved(spikes).inline_max_bytes, Some(0));
        let chosen = format!("{spikes}[server]\ninline_max_bytes = \"16KiB\"\n");
        assert_eq!(resolved(&chosen).inline_max_bytes, Some(16 << 10));
        // Errors only: the backend's own default stays.
        let errors = "[storage]\nmemory = \"1GiB\"\n[[faults.rule]]\nvolume = \"v\"\n\
                      eio_read_permille = 5\n";
        assert_eq!(resolved(errors).inline_max_bytes, None);
    }

    #[test]
    fn faults_reach_the_store_config_and_bad_rules_name_the_key() {
        assert_eq!(faults("").unwrap(), None);
        assert_eq!(faults("[faults]\nseed = 3\n").unwrap(), None);
        let config = faults(
            "[faults]\nseed = 7\n\
             [[faults.rule]]\nvolume = \"v1\"\neio_read_permille = 10\noffset_bytes = \"1MiB\"\n\
             length_bytes = \"4KiB\"\nlatency_spike_permille = 5\nlatency_spike_ms = 20\n\
             [[faults.rule]]\ndevice = 1\neio_sync_permille = 1000\nenospc_after_bytes = \"64MiB\"\n\
             disappear_after_ops = 100\ndisappear_after_ms = 2000\neio_write_permille = 1\n\
             enospc_write_permille = 2\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(config.seed, 7);
        let mut first = FaultRule::new(FaultScope::Volume("v1".into()));
        first.eio_read_permille = 10;
        first.offset_bytes = 1 << 20;
        first.length_bytes = Some(4096);
        first.latency_spike_permille = 5;
        first.latency_spike_ms = 20;
        let mut second = FaultRule::new(FaultScope::Device(1));
        second.eio_sync_permille = 1000;
        second.eio_write_permille = 1;
        second.enospc_write_permille = 2;
        second.enospc_after_bytes = Some(64 << 20);
        second.disappear_after_ops = Some(100);
        second.disappear_after_ms = Some(2000);
        assert_eq!(config.rules, vec![first, second]);

        let err = |text: &str| faults(text).unwrap_err();
        assert!(
            err("[[faults.rule]]\nvolume = \"v\"\neio_read_permille = 1001\n")
                .contains("faults.rule[0].eio_read_permille = 1001: must be at most 1000")
        );
        assert!(
            err("[[faults.rule]]\nvolume = \"v\"\ndevice = 0\neio_read_permille = 1\n")
                .contains("faults.rule[0]: needs exactly one of volume")
        );
        assert!(err("[[faults.rule]]\neio_read_permille = 1\n").contains("exactly one"));
        assert!(err("[[faults.rule]]\nvolume = \"v\"\n").contains("does nothing"));
        assert!(err("[[faults.rule]]\nvolume = \"v\"\neio_reads = 1\n").contains("unknown field"));
        assert!(
            err("[[faults.rule]]\ndevice = 0\nlatency_spike_permille = 1\n")
                .contains("faults.rule[0].latency_spike_ms = 0")
        );
        // The section is taken whole from the highest layer that has one.
        let upper = parse("[[faults.rule]]\ndevice = 0\neio_read_permille = 1\n").unwrap();
        let lower =
            parse("[faults]\nseed = 9\n[[faults.rule]]\ndevice = 1\neio_read_permille = 2\n")
                .unwrap();
        let merged = faults_config(&upper.over(lower.clone())).unwrap().unwrap();
        assert_eq!((merged.seed, merged.rules.len()), (0, 1));
        assert_eq!(merged.rules[0].scope, FaultScope::Device(0));
        let merged = faults_config(&ConfigFile::default().over(lower))
            .unwrap()
            .unwrap();
        assert_eq!(merged.seed, 9);
    }

    #[test]
    fn the_documented_metrics_example_gives_the_defaults_and_bounds_are_checked() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let block = doc
            .split("## Metrics")
            .nth(1)
            .and_then(|section| section.split("```toml\n").nth(1))
            .and_then(|rest| rest.split("```").next())
            .expect("a toml block under \"## Metrics\"");
        let c = resolve(&ConfigFile::parse(block, &path).unwrap()).unwrap();
        assert_eq!(c.metrics, MetricsConfig::default());
        let c = resolved("[metrics]\nvolume_series_idle_s = 60\nmax_volume_series = 5\n");
        assert_eq!(c.metrics.volume_series_idle_s, 60);
        assert_eq!(c.metrics.max_volume_series, 5);
        let e = err("[metrics]\nmax_volume_series = 1000000\n");
        assert!(e.contains("metrics.max_volume_series = 1000000"), "{e}");
        let e = err("[metrics]\nseries = 1\n");
        assert!(e.contains("series"), "{e}");
    }

    #[test]
    fn the_documented_faults_example_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md");
        let doc = std::fs::read_to_string(&path).unwrap();
        let block = doc
            .split("## Fault injection")
            .nth(1)
            .and_then(|section| section.split("```toml\n").nth(1))
            .and_then(|rest| rest.split("```").next())
            .expect("a toml block under \"## Fault injection\"");
        let layer = ConfigFile::parse(block, &path).unwrap();
        let config = faults_config(&layer).unwrap().expect("rules");
        assert!(config.rules.len() >= 2, "{config:?}");
        resolve(&layer).unwrap();
    }
}
