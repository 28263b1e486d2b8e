//! Scenario files: the TOML schema of a simulated node, its tenants and its policies.
//!
//! A scenario is the unit of reproduction: one file in `scenarios/` per experiment, run with
//! one command. The schema is strict (`deny_unknown_fields`) so that a typo is an error rather
//! than a silently ignored knob. A scenario may list *variants* (e.g. queue depths or worker
//! counts): each variant is the same file with a few dotted keys overridden, so a sweep lives
//! in one file and every point of it is run with the same seed.
//!
//! Schema at a glance (every field but `name`, `duration_s`, `groups[].name` and
//! `groups[].workload` has a default; see the field docs below):
//!
//! ```toml
//! name = "example"            # report name
//! duration_s = 3.0            # simulated seconds; warmup_s excluded from statistics
//! policies = ["wild", "base", "burst"]
//! uncapped_policies = ["wild"]  # built with NodeCapacity::UNLIMITED (no node pacer)
//! invariants = "fail"         # or "warn"; checked every check_invariants_ms
//! timeline_ms = 100.0         # throughput-over-time bucket
//! [node]                      # workers, dispatch ("one_to_one" | "stealing" | "one_to_n"),
//! workers = 3                 # steal_cost_ns, sync_overhead_ns, steal_batch, cpu = {...},
//! nic = { ingress_bytes_per_s = 12.5e9, egress_bytes_per_s = 12.5e9 }  # replication, capacity
//! [[node.devices]]            # profile | iocost | curve; latency_ns, parallelism, streams,
//! profile = "ssd_fast"        # rw_interference, layout ("in_place" | "log"), speedup, count
//! [cost]                      # estimator: cpu ("node" | "qos_default"), device ("node" | "vop"
//! device = "node"             # | "constant" | "size" | "affine" | "qos_default" | "none")
//! [policy_params]             # qos::PolicyParams (window_ns, reserve_permille, ...)
//! [[groups]]                  # tenants, queues, hot_queue_share, volume_gib, stats_from_s/to_s
//! name = "victim"
//! qos = { baseline_iops = 20000.0, ceiling_iops = 1e6, burst = "on_demand" }  # or preset = "gp2"
//!                             # credit_pool = "acct-a": credits shared per account (Credit policy)
//! workload = { mode = "open", rate_iops = 10000.0, qd = 32, sizes = "4k", read_fraction = 1.0 }
//! [[actions]]                 # at_s, group, set_qos | replace_volumes (+ start_full, overlap_s,
//! at_s = 1800.0               # rebuild = { io_kib, qd, tenant_io = "raid1" | "new_volume" }),
//! group = "victim"            # every_s
//! replace_volumes = true
//! [[variants]]                # each variant = the file with dotted keys overridden
//! name = "qd8"
//! set = { "groups.victim.workload.qd" = 8, "node.workers" = 8 }
//! ```

use crate::device::DeviceSpec;
use crate::error::SimError;
use crate::worker_cpu::CpuSpec;
use crate::workload::WorkloadSpec;
use headroom_qos::{BurstMode, CreditBucketSpec, CreditSpec, PolicyParams, VolumeQos};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What to do when a policy reports a broken invariant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InvariantMode {
    /// Stop the run with an error naming the seed.
    #[default]
    Fail,
    /// Record and continue.
    Warn,
}

/// How requests reach worker threads (BurstCBS §1.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchMode {
    /// Each tenant queue is pinned to one worker (`(tenant * queues + queue) mod workers`).
    OneToOne,
    /// Pinned as in 1-to-1, but an idle worker steals batches from the busiest worker's ring.
    Stealing,
    /// Requests are sprayed round-robin over all workers (the xDPU's FPGA 1-to-N mapping).
    #[default]
    OneToN,
}

/// Read routing over replicas (FAST §3): the server's own type, `headroom_qos::routing`.
pub use headroom_qos::routing::ReadRouting;

/// Replication of every volume over consecutive devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicationSpec {
    /// Replicas per extent (writes go to all of them in parallel; the slowest completes it).
    pub factor: u32,
    /// Where reads go.
    #[serde(default)]
    pub reads: ReadRouting,
}

/// NIC rates.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicSpec {
    /// Client-to-node bytes per second (write payloads); 0 = unlimited.
    #[serde(default)]
    pub ingress_bytes_per_s: f64,
    /// Node-to-client bytes per second (read payloads); 0 = unlimited.
    #[serde(default)]
    pub egress_bytes_per_s: f64,
}

impl Default for NicSpec {
    fn default() -> Self {
        // One 100 Gb/s port per direction.
        NicSpec {
            ingress_bytes_per_s: 12.5e9,
            egress_bytes_per_s: 12.5e9,
        }
    }
}

/// Capacity per worker handed to the policies (what calibration would measure). Any field left
/// out is derived from the node model: 1 s of CPU per worker, NIC and devices split evenly.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacitySpec {
    /// CPU ns per second per worker.
    pub cpu_ns_per_s: Option<f64>,
    /// Ingress bytes per second per worker.
    pub ingress_bytes_per_s: Option<f64>,
    /// Egress bytes per second per worker.
    pub egress_bytes_per_s: Option<f64>,
    /// Device units per second per worker.
    pub device_units_per_s: Option<f64>,
    /// Multiplies every derived dimension (e.g. 0.95 to keep a safety margin).
    #[serde(default = "one")]
    pub scale: f64,
}

fn one() -> f64 {
    1.0
}

impl Default for CapacitySpec {
    fn default() -> Self {
        CapacitySpec {
            cpu_ns_per_s: None,
            ingress_bytes_per_s: None,
            egress_bytes_per_s: None,
            device_units_per_s: None,
            scale: 1.0,
        }
    }
}

/// The simulated node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Worker threads (each one CPU core).
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// How tenant queues map to workers.
    #[serde(default)]
    pub dispatch: DispatchMode,
    /// Stealing: CPU the thief spends per stolen request, ns.
    #[serde(default)]
    pub steal_cost_ns: u64,
    /// Stealing: extra CPU every worker spends per request for the shared (multi-consumer)
    /// rings, ns.
    #[serde(default)]
    pub sync_overhead_ns: u64,
    /// Stealing: requests a worker pulls from its ring (and at most steals) at a time.
    #[serde(default = "default_batch")]
    pub steal_batch: u32,
    /// Per-I/O CPU cost.
    #[serde(default)]
    pub cpu: CpuSpec,
    /// NIC.
    #[serde(default)]
    pub nic: NicSpec,
    /// Backend devices.
    #[serde(default = "default_devices")]
    pub devices: Vec<DeviceSpec>,
    /// Stripe unit over devices, KiB.
    #[serde(default = "default_stripe_kib")]
    pub stripe_kib: u64,
    /// Replication.
    #[serde(default)]
    pub replication: Option<ReplicationSpec>,
    /// Capacity given to the policies.
    #[serde(default)]
    pub capacity: CapacitySpec,
}

fn default_workers() -> u32 {
    4
}
fn default_batch() -> u32 {
    8
}
fn default_stripe_kib() -> u64 {
    2048
}
fn default_devices() -> Vec<DeviceSpec> {
    vec![DeviceSpec {
        profile: Some("ssd_fast".into()),
        iocost: None,
        curve: None,
        speedup: 1.0,
        parallelism: 0,
        rw_interference: 0.0,
        latency_ns: 80_000,
        layout: Default::default(),
        streams: 1,
        count: 1,
    }]
}

impl Default for NodeSpec {
    fn default() -> Self {
        NodeSpec {
            workers: default_workers(),
            dispatch: DispatchMode::default(),
            steal_cost_ns: 0,
            sync_overhead_ns: 0,
            steal_batch: default_batch(),
            cpu: CpuSpec::default(),
            nic: NicSpec::default(),
            devices: default_devices(),
            stripe_kib: default_stripe_kib(),
            replication: None,
            capacity: CapacitySpec::default(),
        }
    }
}

/// How a volume may burst, as written in a scenario.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BurstSpec {
    /// Never above the baseline.
    #[default]
    None,
    /// On spare capacity, up to the ceiling.
    OnDemand,
    /// While credits last.
    Credits,
}

/// One credit bucket as written in a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BucketSpec {
    /// Maximum balance (I/O units or bytes).
    pub capacity: f64,
    /// Credits per second; default: the baseline in the same dimension.
    #[serde(default)]
    pub refill_per_s: Option<f64>,
    /// Start with a full bucket.
    #[serde(default = "yes")]
    pub start_full: bool,
}

fn yes() -> bool {
    true
}

/// A volume's QoS as written in a scenario (converted to `qos::VolumeQos`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosSpec {
    /// A `headroom-qos` preset (`gp2`, `gp3:iops=6000`, `azure-credit`, `autopl`, `qemu:...`)
    /// applied to the group's volume size; the fields below override parts of it.
    #[serde(default)]
    pub preset: Option<String>,
    /// Guaranteed IOPS (default 0; when only `baseline_mib_s` is given, the IOPS ceiling).
    #[serde(default)]
    pub baseline_iops: Option<f64>,
    /// Guaranteed MiB/s (default 0; when only `baseline_iops` is given, the bytes ceiling).
    #[serde(default)]
    pub baseline_mib_s: Option<f64>,
    /// Maximum IOPS (default unlimited).
    #[serde(default)]
    pub ceiling_iops: Option<f64>,
    /// Maximum MiB/s (default unlimited).
    #[serde(default)]
    pub ceiling_mib_s: Option<f64>,
    /// Burst mode.
    #[serde(default)]
    pub burst: Option<BurstSpec>,
    /// IOPS credit bucket (burst = "credits").
    #[serde(default)]
    pub credit_iops: Option<BucketSpec>,
    /// Bytes credit bucket (burst = "credits").
    #[serde(default)]
    pub credit_bytes: Option<BucketSpec>,
    /// Share of spare capacity.
    #[serde(default)]
    pub weight: Option<u32>,
    /// IOPS accounting unit, KiB (0 = one per request).
    #[serde(default)]
    pub io_unit_kib: Option<u32>,
    /// Shared credit pool (an account): volumes whose QoS names the same pool share their
    /// credit buckets under the Credit policy (`qos::CreditSpec::pool`), so credits are granted
    /// once per account rather than per volume. Needs credit burst mode (e.g. `preset =
    /// "gp2"`). Names are 1–64 characters of `[A-Za-z0-9_.-]`; see [`credit_pool_id`].
    #[serde(default)]
    pub credit_pool: Option<String>,
}

/// The `qos::CreditSpec::pool` id of a scenario's pool name: the 32-bit FNV-1a hash of the
/// name, so that the same name is the same pool in every group and action of a run without a
/// registry. Two names of one scenario hashing alike are rejected by
/// [`ScenarioSpec::validate`].
pub fn credit_pool_id(name: &str) -> Result<u32, SimError> {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if name.is_empty() || name.len() > 64 || !name.chars().all(valid) {
        return Err(SimError::Invalid(format!(
            "credit_pool {name:?}: use 1-64 characters of A-Z, a-z, 0-9, '_', '.', '-'"
        )));
    }
    Ok(name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    }))
}

const MIB: f64 = 1_048_576.0;

fn rate_u64(v: f64, what: &str) -> Result<u64, SimError> {
    if v.is_infinite() && v > 0.0 {
        return Ok(u64::MAX);
    }
    if !(v.is_finite() && v >= 0.0) {
        return Err(SimError::Invalid(format!("{what} must be >= 0, got {v}")));
    }
    Ok(v.round().min(u64::MAX as f64) as u64)
}

impl QosSpec {
    /// Builds the `VolumeQos` this spec describes for a volume of `volume_bytes`.
    pub fn to_volume_qos(&self, volume_bytes: u64) -> Result<VolumeQos, SimError> {
        let mut q = VolumeQos::default();
        if let Some(p) = &self.preset {
            q = headroom_qos::presets::volume_qos(p, volume_bytes)
                .map_err(|e| SimError::Invalid(format!("qos preset: {e}")))?;
        }
        if let Some(v) = self.baseline_iops {
            q.baseline.iops = rate_u64(v, "baseline_iops")?;
        }
        if let Some(v) = self.baseline_mib_s {
            q.baseline.bytes_per_s = rate_u64(v * MIB, "baseline_mib_s")?;
        }
        if let Some(v) = self.ceiling_iops {
            q.ceiling.iops = rate_u64(v, "ceiling_iops")?;
        }
        if let Some(v) = self.ceiling_mib_s {
            q.ceiling.bytes_per_s = rate_u64(v * MIB, "ceiling_mib_s")?;
        }
        // A baseline given in one dimension only guarantees nothing less in the other: the
        // unnamed dimension is bounded by the ceiling alone (20k IOPS of any size).
        match (self.baseline_iops.is_some(), self.baseline_mib_s.is_some()) {
            (true, false) if self.preset.is_none() => {
                q.baseline.bytes_per_s = q.ceiling.bytes_per_s
            }
            (false, true) if self.preset.is_none() => q.baseline.iops = q.ceiling.iops,
            _ => {}
        }
        if let Some(w) = self.weight {
            q.weight = w;
        }
        if let Some(u) = self.io_unit_kib {
            q.io_unit_bytes = u.saturating_mul(1024);
        }
        let bucket = |b: &BucketSpec,
                      default_refill: u64,
                      what: &str|
         -> Result<CreditBucketSpec, SimError> {
            Ok(CreditBucketSpec {
                capacity: rate_u64(b.capacity, what)?,
                refill_per_s: match b.refill_per_s {
                    Some(r) => rate_u64(r, what)?,
                    None => default_refill,
                },
                start_full: b.start_full,
            })
        };
        match self.burst {
            None => {}
            Some(BurstSpec::None) => q.burst = BurstMode::None,
            Some(BurstSpec::OnDemand) => q.burst = BurstMode::OnDemand,
            Some(BurstSpec::Credits) => {
                let mut spec = match q.burst {
                    BurstMode::Credits(s) => s,
                    _ => CreditSpec {
                        iops: None,
                        bytes: None,
                        pool: None,
                    },
                };
                if let Some(b) = &self.credit_iops {
                    spec.iops = Some(bucket(b, q.baseline.iops, "credit_iops")?);
                }
                if let Some(b) = &self.credit_bytes {
                    spec.bytes = Some(bucket(b, q.baseline.bytes_per_s, "credit_bytes")?);
                }
                q.burst = BurstMode::Credits(spec);
            }
        }
        if self.burst.is_none() {
            // Buckets given without an explicit mode still mean credits.
            if let (Some(b), BurstMode::Credits(mut spec)) = (&self.credit_iops, q.burst) {
                spec.iops = Some(bucket(b, q.baseline.iops, "credit_iops")?);
                q.burst = BurstMode::Credits(spec);
            }
        }
        if let Some(name) = &self.credit_pool {
            let id = credit_pool_id(name)?;
            match &mut q.burst {
                BurstMode::Credits(spec) => spec.pool = Some(id),
                BurstMode::None | BurstMode::OnDemand => {
                    return Err(SimError::Invalid(format!(
                        "credit_pool {name:?} needs credit burst mode (burst = \"credits\" or a credit preset such as gp2)"
                    )));
                }
            }
        }
        q.validate()
            .map_err(|e| SimError::Invalid(format!("qos: {e}")))?;
        Ok(q)
    }
}

/// A group of identical tenants; results are reported per group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    /// Group name (a column of the report).
    pub name: String,
    /// Number of tenants (volumes) in the group (trace groups: at most this many devices,
    /// 0 = all).
    #[serde(default = "default_tenants")]
    pub tenants: u32,
    /// Submission queues per tenant (VM vCPU queues).
    #[serde(default = "default_queues")]
    pub queues: u32,
    /// Share of a tenant's I/O on its queue 0 (the busiest vCPU; BurstCBS measured 80.51 %);
    /// 0 = spread evenly.
    #[serde(default)]
    pub hot_queue_share: f64,
    /// Volume size, GiB (bounds random offsets; places the tenant's data on the devices).
    #[serde(default = "default_volume_gib")]
    pub volume_gib: f64,
    /// QoS of each tenant.
    #[serde(default)]
    pub qos: QosSpec,
    /// What each tenant does.
    pub workload: WorkloadSpec,
    /// Count only I/Os completing at or after this time (default: `warmup_s`).
    #[serde(default)]
    pub stats_from_s: Option<f64>,
    /// Count only I/Os completing before this time (default: the end).
    #[serde(default)]
    pub stats_to_s: Option<f64>,
}

impl GroupSpec {
    /// Volume size in bytes (at least 1 MiB).
    pub fn volume_bytes(&self) -> u64 {
        ((self.volume_gib * 1_073_741_824.0) as u64).max(1 << 20)
    }
}

fn default_tenants() -> u32 {
    1
}
fn default_queues() -> u32 {
    1
}
fn default_volume_gib() -> f64 {
    100.0
}

/// A timed change during the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionSpec {
    /// When, seconds.
    pub at_s: f64,
    /// Group whose tenants are affected.
    pub group: String,
    /// New QoS for every tenant of the group (`update_qos`: credits are kept).
    #[serde(default)]
    pub set_qos: Option<QosSpec>,
    /// Move every tenant of the group to a freshly created volume (new id, the group's QoS, so
    /// a gp2 volume starts with a full bucket) and delete the old one; queued requests follow.
    /// This is the "More IOPS for Less" rotation (docs/background.md §5.5).
    #[serde(default)]
    pub replace_volumes: bool,
    /// With `replace_volumes`: override whether the new volumes' credit buckets start full
    /// (`false` roughly approximates credits granted per account; `credit_pool` on the group's
    /// qos models them exactly: a replacement joining a pool never brings credits).
    #[serde(default)]
    pub start_full: Option<bool>,
    /// With `replace_volumes`: how long the old volume stays provisioned (billed) while the
    /// mirror rebuilds, seconds. With `rebuild`, the least time: the old volume is released
    /// when its copy is done and no request uses it, but not before `overlap_s`.
    #[serde(default)]
    pub overlap_s: f64,
    /// With `replace_volumes`: simulate the mirror rebuild (off by default: the old volume is
    /// dropped at once and `overlap_s` is only billed).
    #[serde(default)]
    pub rebuild: Option<RebuildSpec>,
    /// Repeat every this many seconds until the end (0 = once).
    #[serde(default)]
    pub every_s: f64,
}

/// Where a tenant's own I/O goes while its volume is rebuilt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RebuildTenantIo {
    /// As Linux md RAID-1 with the new volume recovering: reads of blocks not yet copied come
    /// from the old volume, writes go to both volumes and complete when both have.
    #[default]
    Raid1,
    /// Everything goes to the new volume at once; only the copy touches the old one (a lower
    /// bound on the overhead).
    NewVolume,
}

/// The mirror rebuild of a replaced volume (`rebuild = { io_kib = 256, qd = 4 }`): the node
/// copies the whole volume, reading `io_kib` chunks in order from the old volume and writing
/// each one to the new volume when its read completes, with at most `qd` chunks in flight.
/// The copy goes through the policies like tenant I/O, so it spends both volumes' IOPS,
/// throughput and credits, and is reported apart from the tenant's own I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RebuildSpec {
    /// Copy chunk, KiB (1–65,536; default 256, AWS's I/O accounting unit).
    #[serde(default = "default_rebuild_io_kib")]
    pub io_kib: u32,
    /// Chunks in flight (1–1,024; default 4).
    #[serde(default = "default_rebuild_qd")]
    pub qd: u32,
    /// Where the tenant's own I/O goes during the copy (default `raid1`).
    #[serde(default)]
    pub tenant_io: RebuildTenantIo,
}

fn default_rebuild_io_kib() -> u32 {
    256
}
fn default_rebuild_qd() -> u32 {
    4
}

/// A named override set: `set` maps dotted keys (`node.workers`, `groups.victim.workload.qd`,
/// where a group is addressed by name) to values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantSpec {
    /// Variant name (reported next to the policy).
    pub name: String,
    /// Overrides.
    #[serde(default)]
    pub set: toml::Table,
}

/// The scenario file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSpec {
    /// Scenario name.
    pub name: String,
    /// What it reproduces.
    #[serde(default)]
    pub description: String,
    /// Simulated time, seconds.
    pub duration_s: f64,
    /// Time excluded from statistics at the start, seconds.
    #[serde(default)]
    pub warmup_s: f64,
    /// Policies run by default.
    #[serde(default = "default_policies")]
    pub policies: Vec<String>,
    /// Throughput-over-time bucket, ms.
    #[serde(default = "default_timeline_ms")]
    pub timeline_ms: f64,
    /// Check the policies' invariants every this many simulated ms (0 = only at the end).
    #[serde(default = "default_check_ms")]
    pub check_invariants_ms: f64,
    /// What a broken policy invariant does: `fail` the run (default) or `warn` (count it, keep
    /// the first message in the report's details, continue).
    #[serde(default)]
    pub invariants: InvariantMode,
    /// The node.
    #[serde(default)]
    pub node: NodeSpec,
    /// Policy tunables (`qos::PolicyParams`).
    #[serde(default)]
    pub policy_params: PolicyParams,
    /// The cost estimator the workers run (`qos::CostModel`).
    #[serde(default)]
    pub cost: crate::costs::CostSpec,
    /// Policies built with an unlimited node capacity (no node pacer). WildCBS had no global
    /// rate limiter (docs/background.md §1.6): giving `wild` the capacity would model a better Wild
    /// than the one BurstCBS compared against.
    #[serde(default)]
    pub uncapped_policies: Vec<String>,
    /// Tenant groups.
    pub groups: Vec<GroupSpec>,
    /// Timed changes.
    #[serde(default)]
    pub actions: Vec<ActionSpec>,
    /// Variants (sweep points); none = the file as written.
    #[serde(default)]
    pub variants: Vec<VariantSpec>,
}

fn default_policies() -> Vec<String> {
    vec!["wild".into(), "base".into(), "burst".into()]
}
fn default_timeline_ms() -> f64 {
    100.0
}
fn default_check_ms() -> f64 {
    1_000.0
}

impl ScenarioSpec {
    /// Checks everything that can be checked without running.
    pub fn validate(&self) -> Result<(), SimError> {
        let inv = |m: String| Err(SimError::Invalid(m));
        if self.name.trim().is_empty() {
            return inv("name is empty".into());
        }
        if !(self.duration_s.is_finite() && self.duration_s > 0.0 && self.duration_s <= 1e6) {
            return inv(format!(
                "duration_s {} must be in (0, 1e6]",
                self.duration_s
            ));
        }
        if !(self.warmup_s >= 0.0 && self.warmup_s < self.duration_s) {
            return inv(format!(
                "warmup_s {} must be in [0, duration_s)",
                self.warmup_s
            ));
        }
        if !(self.timeline_ms.is_finite() && self.timeline_ms >= 1.0) {
            return inv(format!("timeline_ms {} must be >= 1", self.timeline_ms));
        }
        if self.duration_s * 1000.0 / self.timeline_ms > 2_000_000.0 {
            return inv("timeline has more than 2 M buckets; raise timeline_ms".into());
        }
        if self.check_invariants_ms.is_nan() || self.check_invariants_ms < 0.0 {
            return inv("check_invariants_ms must be >= 0".into());
        }
        let n = &self.node;
        if n.workers == 0 || n.workers > 1024 {
            return inv(format!("node.workers {} must be in [1, 1024]", n.workers));
        }
        if n.steal_batch == 0 {
            return inv("node.steal_batch must be >= 1".into());
        }
        if n.devices.is_empty() {
            return inv("node.devices is empty".into());
        }
        let mut ndev = 0u32;
        for d in &n.devices {
            d.curve()?;
            if d.count == 0 {
                return inv("device count must be >= 1".into());
            }
            ndev += d.count;
        }
        if ndev > 4096 {
            return inv("more than 4096 devices".into());
        }
        if n.stripe_kib == 0 {
            return inv("node.stripe_kib must be >= 1".into());
        }
        if let Some(r) = &n.replication
            && (r.factor == 0 || r.factor > ndev)
        {
            return inv(format!(
                "replication factor {} must be in [1, number of devices = {ndev}]",
                r.factor
            ));
        }
        for v in [n.nic.ingress_bytes_per_s, n.nic.egress_bytes_per_s] {
            if v.is_nan() || v < 0.0 {
                return inv("NIC rates must be >= 0".into());
            }
        }
        if n.capacity.scale.is_nan() || n.capacity.scale <= 0.0 {
            return inv("node.capacity.scale must be > 0".into());
        }
        if self.groups.is_empty() {
            return inv("no tenant groups".into());
        }
        let mut names: Vec<&str> = Vec::new();
        let mut total_tenants = 0u64;
        for g in &self.groups {
            if g.name.trim().is_empty() {
                return inv("a group has an empty name".into());
            }
            if names.contains(&g.name.as_str()) {
                return inv(format!("group name {:?} is used twice", g.name));
            }
            names.push(&g.name);
            if g.queues == 0 || g.queues > 1024 {
                return inv(format!("group {}: queues must be in [1, 1024]", g.name));
            }
            if !(0.0..=1.0).contains(&g.hot_queue_share) {
                return inv(format!("group {}: hot_queue_share outside [0, 1]", g.name));
            }
            if !(g.volume_gib.is_finite() && g.volume_gib > 0.0 && g.volume_gib <= 1e6) {
                return inv(format!("group {}: volume_gib must be in (0, 1e6]", g.name));
            }
            g.workload
                .validate()
                .map_err(|e| SimError::Invalid(format!("group {}: {e}", g.name)))?;
            g.qos
                .to_volume_qos(g.volume_bytes())
                .map_err(|e| SimError::Invalid(format!("group {}: {e}", g.name)))?;
            if let (Some(a), Some(b)) = (g.stats_from_s, g.stats_to_s)
                && b <= a
            {
                return inv(format!(
                    "group {}: stats_to_s must exceed stats_from_s",
                    g.name
                ));
            }
            total_tenants += u64::from(g.tenants);
        }
        if total_tenants > 1_000_000 {
            return inv("more than 1,000,000 tenants".into());
        }
        for a in &self.actions {
            if !names.contains(&a.group.as_str()) {
                return inv(format!("action refers to unknown group {:?}", a.group));
            }
            if !(a.at_s >= 0.0 && a.every_s >= 0.0 && a.overlap_s >= 0.0) {
                return inv("action at_s, every_s and overlap_s must be >= 0".into());
            }
            if a.every_s > 0.0 && a.every_s < 1e-3 {
                return inv("action every_s must be at least 1 ms".into());
            }
            if let Some(r) = &a.rebuild {
                if !a.replace_volumes {
                    return inv(format!(
                        "action on group {}: rebuild needs replace_volumes = true",
                        a.group
                    ));
                }
                if r.io_kib == 0 || r.io_kib > 65_536 {
                    return inv(format!(
                        "action on group {}: rebuild.io_kib {} must be in [1, 65536]",
                        a.group, r.io_kib
                    ));
                }
                if r.qd == 0 || r.qd > 1024 {
                    return inv(format!(
                        "action on group {}: rebuild.qd {} must be in [1, 1024]",
                        a.group, r.qd
                    ));
                }
            }
            if let (Some(q), Some(g)) = (&a.set_qos, self.groups.iter().find(|g| g.name == a.group))
            {
                q.to_volume_qos(g.volume_bytes())?;
            }
        }
        if self.policies.is_empty() {
            return inv("no policies listed".into());
        }
        self.check_credit_pool_names()
    }

    /// Pool names map to ids by hash: two different names of this scenario must not collide.
    fn check_credit_pool_names(&self) -> Result<(), SimError> {
        let names = self
            .groups
            .iter()
            .map(|g| &g.qos)
            .chain(self.actions.iter().filter_map(|a| a.set_qos.as_ref()))
            .filter_map(|q| q.credit_pool.as_deref());
        let mut seen: Vec<(u32, &str)> = Vec::new();
        for name in names {
            let id = credit_pool_id(name)?;
            match seen.iter().find(|(i, _)| *i == id) {
                Some((_, other)) if *other != name => {
                    return Err(SimError::Invalid(format!(
                        "credit pools {other:?} and {name:?} hash to the same id {id}; rename one"
                    )));
                }
                Some(_) => {}
                None => seen.push((id, name)),
            }
        }
        Ok(())
    }
}

/// A loaded scenario, with its variants expanded.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub(crate) base: ScenarioSpec,
    /// `(variant name, spec)`; one entry named "" when the file has no variants.
    pub(crate) variants: Vec<(String, ScenarioSpec)>,
    /// Directory trace paths are relative to.
    pub(crate) base_dir: PathBuf,
}

impl Scenario {
    /// Parses a scenario from TOML text (trace paths are relative to the current directory).
    pub fn from_toml_str(s: &str) -> Result<Scenario, SimError> {
        Self::parse(s, PathBuf::from("."))
    }

    /// Reads and parses a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        Self::parse(&text, dir).map_err(|e| match e {
            SimError::Toml(m) => SimError::Toml(format!("{}: {m}", path.display())),
            SimError::Invalid(m) => SimError::Invalid(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    fn parse(s: &str, base_dir: PathBuf) -> Result<Scenario, SimError> {
        let raw: toml::Table = toml::from_str(s).map_err(|e| SimError::Toml(e.to_string()))?;
        let base: ScenarioSpec = raw
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| SimError::Toml(e.to_string()))?;
        base.validate()?;
        let mut variants = Vec::new();
        if base.variants.is_empty() {
            variants.push((String::new(), base.clone()));
        } else {
            for v in &base.variants {
                let mut t = raw.clone();
                t.remove("variants");
                for (key, value) in &v.set {
                    set_dotted(&mut t, key, value.clone())
                        .map_err(|m| SimError::Invalid(format!("variant {}: {m}", v.name)))?;
                }
                let spec: ScenarioSpec = t.try_into().map_err(|e: toml::de::Error| {
                    SimError::Toml(format!("variant {}: {e}", v.name))
                })?;
                spec.validate()
                    .map_err(|e| SimError::Invalid(format!("variant {}: {e}", v.name)))?;
                variants.push((v.name.clone(), spec));
            }
        }
        Ok(Scenario {
            base,
            variants,
            base_dir,
        })
    }

    /// The scenario's name.
    pub fn name(&self) -> &str {
        &self.base.name
    }

    /// The policies the file asks for.
    pub fn default_policies(&self) -> Vec<String> {
        self.base.policies.clone()
    }

    /// The parsed file (before variant overrides).
    pub fn spec(&self) -> &ScenarioSpec {
        &self.base
    }

    /// Every variant with its spec (one entry named "" when the file has no variants): what
    /// `headroom lab run` translates into real load.
    pub fn variants(&self) -> &[(String, ScenarioSpec)] {
        &self.variants
    }

    /// Names of the variants ("" when there are none).
    pub fn variant_names(&self) -> Vec<String> {
        self.variants.iter().map(|v| v.0.clone()).collect()
    }
}

/// Sets `a.b.c = value` in a TOML table; an array of tables is indexed by the `name` of its
/// elements (or a numeric index).
fn set_dotted(root: &mut toml::Table, key: &str, value: toml::Value) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut wrapped = toml::Value::Table(std::mem::take(root));
    let result = set_path(&mut wrapped, &parts, value, key);
    if let toml::Value::Table(t) = wrapped {
        *root = t;
    }
    result
}

fn set_path(
    cur: &mut toml::Value,
    parts: &[&str],
    value: toml::Value,
    key: &str,
) -> Result<(), String> {
    let Some((first, rest)) = parts.split_first() else {
        *cur = value;
        return Ok(());
    };
    match cur {
        toml::Value::Table(t) => {
            if rest.is_empty() {
                t.insert((*first).to_string(), value);
                return Ok(());
            }
            let next = t
                .entry((*first).to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            set_path(next, rest, value, key)
        }
        toml::Value::Array(items) => {
            let index = first.parse::<usize>().ok().or_else(|| {
                items
                    .iter()
                    .position(|v| v.get("name").and_then(|n| n.as_str()) == Some(*first))
            });
            let Some(item) = index.and_then(|i| items.get_mut(i)) else {
                return Err(format!("{key}: no element named {first:?}"));
            };
            if rest.is_empty() {
                return Err(format!("{key}: name a field of element {first:?}"));
            }
            set_path(item, rest, value, key)
        }
        _ => Err(format!(
            "{key}: {first:?} is below a value that is not a table"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        name = "t"
        duration_s = 1.0
        [[groups]]
        name = "a"
        workload = { mode = "closed", qd = 4 }
    "#;

    #[test]
    fn minimal_scenario_parses_with_defaults() {
        let s = Scenario::from_toml_str(MINIMAL).unwrap();
        assert_eq!(s.name(), "t");
        assert_eq!(s.default_policies(), vec!["wild", "base", "burst"]);
        assert_eq!(s.variants.len(), 1);
        assert_eq!(s.base.node.workers, 4);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        let typo = MINIMAL.replace("duration_s", "durations");
        assert!(matches!(
            Scenario::from_toml_str(&typo),
            Err(SimError::Toml(_))
        ));
        let zero = MINIMAL.replace("qd = 4", "qd = 0");
        let err = Scenario::from_toml_str(&zero).unwrap_err().to_string();
        assert!(err.contains("qd"), "{err}");
    }

    #[test]
    fn variants_override_dotted_keys_and_groups_by_name() {
        let text = format!(
            "{MINIMAL}\n[[variants]]\nname = \"w1\"\nset = {{ \"node.workers\" = 1, \"groups.a.workload.qd\" = 9 }}\n"
        );
        let s = Scenario::from_toml_str(&text).unwrap();
        assert_eq!(s.variants.len(), 1);
        let (name, v) = &s.variants[0];
        assert_eq!(name, "w1");
        assert_eq!(v.node.workers, 1);
        assert_eq!(v.groups[0].workload.qd, 9);
        let bad = format!(
            "{MINIMAL}\n[[variants]]\nname = \"x\"\nset = {{ \"groups.nope.workload.qd\" = 9 }}\n"
        );
        assert!(Scenario::from_toml_str(&bad).is_err());
    }

    #[test]
    fn rebuilds_are_opt_in_and_checked() {
        let action = |extra: &str| {
            format!(
                "{MINIMAL}\n[[actions]]\nat_s = 0.5\ngroup = \"a\"\nreplace_volumes = true\n{extra}\n"
            )
        };
        let s = Scenario::from_toml_str(&action("")).unwrap();
        assert_eq!(s.base.actions[0].rebuild, None, "off unless asked for");
        let s = Scenario::from_toml_str(&action("rebuild = {}")).unwrap();
        assert_eq!(
            s.base.actions[0].rebuild,
            Some(RebuildSpec {
                io_kib: 256,
                qd: 4,
                tenant_io: RebuildTenantIo::Raid1
            })
        );
        let s = Scenario::from_toml_str(&action(
            "rebuild = { io_kib = 64, qd = 32, tenant_io = \"new_volume\" }",
        ))
        .unwrap();
        assert_eq!(
            s.base.actions[0]
                .rebuild
                .map(|r| (r.io_kib, r.qd, r.tenant_io)),
            Some((64, 32, RebuildTenantIo::NewVolume))
        );
        for (bad, needle) in [
            ("rebuild = { io_kib = 0 }", "rebuild.io_kib"),
            ("rebuild = { io_kib = 65537 }", "rebuild.io_kib"),
            ("rebuild = { qd = 0 }", "rebuild.qd"),
            ("rebuild = { qd = 1025 }", "rebuild.qd"),
        ] {
            let err = Scenario::from_toml_str(&action(bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
        for typo in [
            "rebuild = { io_kb = 64 }",
            "rebuild = { tenant_io = \"raid0\" }",
        ] {
            assert!(
                matches!(
                    Scenario::from_toml_str(&action(typo)),
                    Err(SimError::Toml(_))
                ),
                "{typo}"
            );
        }
        let without_replace = action("rebuild = {}").replace("replace_volumes = true", "");
        let err = Scenario::from_toml_str(&without_replace)
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs replace_volumes"), "{err}");
    }

    #[test]
    fn credit_pools_are_named_per_group_and_checked() {
        let gib = 1u64 << 30;
        let pool_of = |q: &QosSpec| match q.to_volume_qos(10 * gib) {
            Ok(VolumeQos {
                burst: BurstMode::Credits(c),
                ..
            }) => c.pool,
            other => panic!("credits expected, got {other:?}"),
        };
        let gp2 = |pool: &str| QosSpec {
            preset: Some("gp2".into()),
            credit_pool: Some(pool.into()),
            ..QosSpec::default()
        };
        let a = pool_of(&gp2("acct-a"));
        assert!(a.is_some());
        assert_eq!(pool_of(&gp2("acct-a")), a, "same name, same pool");
        assert_ne!(pool_of(&gp2("acct-b")), a);
        let no_pool = QosSpec {
            preset: Some("gp2".into()),
            ..QosSpec::default()
        };
        assert_eq!(pool_of(&no_pool), None);
        // Invalid names and pools without credits are errors.
        for bad in ["", "acct a", "ä"] {
            let err = gp2(bad).to_volume_qos(10 * gib).unwrap_err().to_string();
            assert!(err.contains("credit_pool"), "{err}");
        }
        let on_demand = QosSpec {
            burst: Some(BurstSpec::OnDemand),
            credit_pool: Some("acct-a".into()),
            ..QosSpec::default()
        };
        let err = on_demand.to_volume_qos(gib).unwrap_err().to_string();
        assert!(err.contains("credit burst mode"), "{err}");
        // In a file; two names with the same FNV-1a hash are rejected.
        let file = |b: &str| {
            format!(
                "{MINIMAL}\nqos = {{ preset = \"gp2\", credit_pool = \"acct-rrgs\" }}\n[[groups]]\nname = \"b\"\nworkload = {{ mode = \"closed\", qd = 4 }}\nqos = {{ preset = \"gp2\", credit_pool = \"{b}\" }}\n"
            )
        };
        assert!(Scenario::from_toml_str(&file("acct-rrgs")).is_ok());
        assert!(Scenario::from_toml_str(&file("acct-b")).is_ok());
        let err = Scenario::from_toml_str(&file("acct-jbaxa"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("same id"), "{err}");
    }

    #[test]
    fn qos_spec_uses_presets_and_overrides() {
        let gib = 1u64 << 30;
        let q = QosSpec {
            preset: Some("gp2".into()),
            ..QosSpec::default()
        }
        .to_volume_qos(100 * gib)
        .unwrap();
        assert_eq!(q.baseline.iops, 300);
        assert_eq!(q.ceiling.iops, 3_000);
        assert!(matches!(q.burst, BurstMode::Credits(_)));
        let custom = QosSpec {
            baseline_iops: Some(20_000.0),
            ceiling_mib_s: Some(100.0),
            burst: Some(BurstSpec::OnDemand),
            ..QosSpec::default()
        }
        .to_volume_qos(gib)
        .unwrap();
        assert_eq!(custom.baseline.iops, 20_000);
        assert_eq!(
            custom.baseline.bytes_per_s,
            100 << 20,
            "unnamed baseline = ceiling"
        );
        assert_eq!(custom.ceiling.iops, u64::MAX);
        assert_eq!(custom.ceiling.bytes_per_s, 100 << 20);
        assert_eq!(custom.burst, BurstMode::OnDemand);
        let credits = QosSpec {
            baseline_iops: Some(100.0),
            ceiling_iops: Some(1_000.0),
            burst: Some(BurstSpec::Credits),
            credit_iops: Some(BucketSpec {
                capacity: 9_000.0,
                refill_per_s: None,
                start_full: true,
            }),
            ..QosSpec::default()
        }
        .to_volume_qos(gib)
        .unwrap();
        let BurstMode::Credits(c) = credits.burst else {
            panic!("credits expected")
        };
        assert_eq!(
            c.iops.map(|b| (b.capacity, b.refill_per_s)),
            Some((9_000, 100))
        );
        let bad = QosSpec {
            preset: Some("nope".into()),
            ..QosSpec::default()
        };
        assert!(bad.to_volume_qos(gib).is_err());
        let inverted = QosSpec {
            baseline_iops: Some(10.0),
            ceiling_iops: Some(5.0),
            ..QosSpec::default()
        };
        assert!(inverted.to_volume_qos(gib).is_err());
    }
}
