//! A lab run, part one: a scenario file (the simulator's format, parsed by
//! `headroom-sim`) translated into what a real run needs: the server's configuration (an
//! emulated device with the scenario's cost model, the scheduler charging the same model),
//! each group's volumes with their QoS as the API spells it, and each tenant's load.
//!
//! Why a translation with a ledger rather than a second format: the point of the lab is that
//! the *same file* runs in the simulator and on real I/O. Some keys only the simulator can
//! honour (a 100 Gb/s NIC, a worker's CPU model, invariant checks) and some only approximately
//! (a measured device curve becomes a linear model). Each such key is recorded in
//! [`NotHonoured`] with the reason, printed on stderr and listed in the JSON, never dropped
//! silently. A load the lab cannot generate at all (a trace, a queue deeper than a connection
//! may hold) is an error naming the file, the key and the reason.

use std::path::{Path, PathBuf};

use headroom_qos::model::{DeviceModel, VopCurve};
use headroom_qos::{BurstKind, BurstMode, PolicyParams, QosSpec as ApiQos, VolumeQos};
use headroom_qos::{OpKind, PolicyKind};
use headroom_sim::costs::{CostSpec, DeviceEstimate};
use headroom_sim::device::{DeviceSpec, IoCostProfile, Layout};
use headroom_sim::scenario::{
    BurstSpec, CapacitySpec, DispatchMode, GroupSpec, InvariantMode, NicSpec, QosSpec, ScenarioSpec,
};
use headroom_sim::worker_cpu::CpuSpec;
use headroom_sim::workload::{Arrival, Mode, Pattern, SizeMix as SimSizeMix};
use serde::Serialize;
use std::time::Duration;

use crate::{ArrivalKind, LoadMode, Schedule, SizeMix, SplitMix64};

/// Most requests a tenant keeps in flight: the generator's bound and the server's default
/// `limits.max_inflight_requests`.
pub const MAX_IN_FLIGHT: u32 = crate::MAX_QUEUE_DEPTH;
/// Most connections (tenants) in one run: the server's default `limits.max_connections`.
pub const MAX_TENANTS: u64 = 256;
/// I/O offsets stay in the first this many bytes of each volume, so written data fits in RAM
/// (volumes are still created at the scenario's size).
pub const REGION_CAP_BYTES: u64 = 256 << 20;
/// Channels of the emulated device when the scenario leaves parallelism unbounded.
pub const DEFAULT_PARALLELISM: u32 = 16;

/// A scenario key the lab does not honour (or only approximately), and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NotHonoured {
    /// Dotted key (`node.nic`, `groups.victim.queues`).
    pub key: String,
    /// What the lab does instead.
    pub reason: String,
}

/// One group's volumes and load, before the server's address is known.
#[derive(Clone, Debug)]
pub struct GroupPlan {
    pub name: String,
    pub tenants: u32,
    pub volume_bytes: u64,
    pub region_bytes: u64,
    /// The QoS each volume is created with, through the API.
    pub qos: ApiQos,
    /// What it resolves to (the peers' throttles are set from it).
    pub limits: VolumeQos,
    /// `None`: an idle group (volumes, no load).
    pub mode: Option<LoadMode>,
    pub sizes: SizeMix,
    pub read_permille: u32,
    pub sequential: bool,
    /// Per tenant (the on/off phase may differ per tenant).
    pub phases: Vec<Schedule>,
    pub stats_from: Duration,
    pub stats_to: Duration,
}

/// One variant of a scenario, ready to run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub variant: String,
    pub duration: Duration,
    pub timeline: Duration,
    pub groups: Vec<GroupPlan>,
    /// The server's configuration file (TOML), without the policy.
    pub server_config: String,
    pub not_honoured: Vec<NotHonoured>,
}

/// A scenario the lab cannot run: the file, the key and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {key}: {reason}", file.display())]
pub struct PlanError {
    /// The scenario file (for messages only).
    pub file: PathBuf,
    /// Dotted key (`groups.victim.workload.qd`), or `cost` for the cost estimate as a whole.
    pub key: String,
    /// Why the lab cannot honour it.
    pub reason: String,
}

type Result<T> = std::result::Result<T, PlanError>;

impl PlanError {
    fn new(file: &Path, key: &str, reason: impl std::fmt::Display) -> PlanError {
        PlanError {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// An error naming the file, the key and the reason.
fn fail<T>(file: &Path, key: &str, reason: impl std::fmt::Display) -> Result<T> {
    Err(PlanError::new(file, key, reason))
}

/// The policy names `lab run` accepts for the live server: the server's own, and `fifo`
/// (the simulator's unscheduled reference) as the server's `off`.
pub fn server_policy(name: &str) -> Option<String> {
    if name.trim().eq_ignore_ascii_case("fifo") {
        return Some("off".into());
    }
    // The server's own names (its `PolicyChoice`): `off`, or a policy of `headroom-qos`.
    if name.trim().eq_ignore_ascii_case("off") || name.parse::<PolicyKind>().is_ok() {
        return Some(name.trim().to_ascii_lowercase());
    }
    None
}

/// Translates one variant. `file` is only for messages.
pub fn plan(file: &Path, variant: &str, spec: &ScenarioSpec, seed: u64) -> Result<Plan> {
    let mut notes = Vec::new();
    let mut note = |key: &str, reason: &str| {
        notes.push(NotHonoured {
            key: key.to_string(),
            reason: reason.to_string(),
        });
    };
    let n = &spec.node;

    // The node: scheduler workers and dispatch are the server's too.
    if !(1..=64).contains(&n.workers) {
        return fail(
            file,
            "node.workers",
            format!(
                "{} is outside the server's qos.workers range 1..=64",
                n.workers
            ),
        );
    }
    let dispatch = match n.dispatch {
        DispatchMode::OneToOne => "one-to-one",
        DispatchMode::Stealing => "stealing",
        DispatchMode::OneToN => "one-to-n",
    };
    if n.steal_cost_ns != 0 || n.sync_overhead_ns != 0 {
        note(
            "node.steal_cost_ns / node.sync_overhead_ns",
            "modelled CPU costs of stealing; the real server pays its own",
        );
    }
    if n.steal_batch != 8 {
        note("node.steal_batch", "the server's stealing batch is its own");
    }
    // The simulator always models a worker CPU cost and a NIC (defaults when the file names
    // none); the lab never does, so these are listed whether or not the file sets them.
    note(
        "node.cpu",
        if n.cpu == CpuSpec::default() {
            "the simulator's default per-I/O CPU cost; the real server spends what it spends on this machine's CPUs (shared with the generator)"
        } else {
            "the simulated per-I/O CPU cost; the real server spends what it spends on this machine's CPUs (shared with the generator)"
        },
    );
    note(
        "node.nic",
        if n.nic == NicSpec::default() {
            "the simulator's default 100 Gb/s per direction; loopback is the lab's NIC, no link rate is emulated"
        } else {
            "loopback is the lab's NIC; no link rate is emulated"
        },
    );
    if n.stripe_kib != 2048 {
        note(
            "node.stripe_kib",
            "one emulated device: nothing to stripe over",
        );
    }
    if n.replication.is_some() {
        note(
            "node.replication",
            "the server keeps one copy; no replicas are emulated",
        );
    }
    // `scale` is honoured for the device dimension (the scheduler's device_units_per_s is the
    // emulated device's capacity times it); the rest is not.
    let capacity_scale = n.capacity.scale;
    if !(capacity_scale.is_finite() && capacity_scale > 0.0 && capacity_scale <= 10.0) {
        return fail(
            file,
            "node.capacity.scale",
            format!("{capacity_scale}: the lab takes 0 < scale <= 10"),
        );
    }
    if n.capacity
        != (CapacitySpec {
            scale: capacity_scale,
            ..CapacitySpec::default()
        })
    {
        note(
            "node.capacity",
            "the scheduler gets the emulated device's capacity (times node.capacity.scale) and its default CPU capacity",
        );
    } else if capacity_scale != 1.0 {
        note(
            "node.capacity.scale",
            "applied to the device dimension only (the server's CPU capacity is its default)",
        );
    }
    // The device estimate (`cost.device`) and the write-cost AIMD are the server's too (see
    // `server_cost` below); the CPU estimate is not.
    let d = CostSpec::default();
    if spec.cost.cpu != d.cpu || spec.cost.cpu_scale != d.cpu_scale {
        note(
            "cost.cpu / cost.cpu_scale",
            "the server charges its own [qos.cost.cpu] (BurstCBS's line)",
        );
    }
    if spec.cost.delay_adjust != d.delay_adjust {
        note(
            "cost.delay_adjust",
            "the server's delay-based CPU adjustment is always on",
        );
    }
    if spec.policy_params != PolicyParams::default() {
        note("policy_params", "the server runs its default [qos.params]");
    }
    if spec.invariants != InvariantMode::Fail || spec.check_invariants_ms != 1_000.0 {
        note(
            "invariants / check_invariants_ms",
            "invariant checks are the simulator's",
        );
    }
    if !spec.uncapped_policies.is_empty() {
        note(
            "uncapped_policies",
            "the live server gives every policy the node's capacity: its wild runs with the node pacer (weighted round robin in the scheduler), not uncapped into the device queue",
        );
    }
    if !spec.actions.is_empty() {
        note("actions", "timed changes are not run by the lab");
    }

    // The device: the first entry becomes the emulated device.
    let Some(device) = n.devices.first() else {
        return fail(file, "node.devices", "is empty");
    };
    if n.devices.len() > 1 {
        note(
            "node.devices",
            "only the first device entry is emulated (its count and speedup scale it)",
        );
    }
    // A measured curve (a table) is emulated as a curve; anything else as the linear model.
    let is_curve = device.profile.is_none() && device.iocost.is_none() && device.curve.is_some();
    let profile = device_profile(file, device, &mut note)?;
    let parallelism = match device.parallelism {
        0 => {
            note(
                "node.devices.parallelism",
                &format!(
                    "unbounded in the simulator; the emulated device has {DEFAULT_PARALLELISM} channels"
                ),
            );
            DEFAULT_PARALLELISM
        }
        p if p > 1024 => {
            return fail(
                file,
                "node.devices.parallelism",
                format!("{p}: the emulated device has at most 1024 channels"),
            );
        }
        p => p,
    };
    if device.latency_ns > 0 {
        note(
            "node.devices.latency_ns",
            "the emulated device has no separate access latency: an idle request takes parallelism x its cost",
        );
    }
    if device.layout == Layout::Log {
        note("node.devices.layout", "the emulated device writes in place");
    }
    if device.streams != 1 {
        note(
            "node.devices.streams",
            "the emulated device has no stream detection",
        );
    }
    let interference = (device.rw_interference * 1000.0).round();
    if !(0.0..=10_000.0).contains(&interference) {
        return fail(
            file,
            "node.devices.rw_interference",
            format!(
                "{}: the emulated device takes 0..=10",
                device.rw_interference
            ),
        );
    }

    // Groups.
    let total_tenants: u64 = spec.groups.iter().map(|g| u64::from(g.tenants)).sum();
    if total_tenants > MAX_TENANTS {
        return fail(
            file,
            "groups.tenants",
            format!(
                "{total_tenants} tenants in all: the lab opens one connection per tenant and the server takes at most {MAX_TENANTS}"
            ),
        );
    }
    let mut rng = SplitMix64::new(seed ^ 0x6c61_625f_7068_6173);
    let mut groups = Vec::new();
    let mut memory = 256u64 << 20;
    for g in &spec.groups {
        let plan = group_plan(file, spec, g, &mut rng, &mut note)?;
        memory += u64::from(plan.tenants) * (plan.region_bytes + (plan.region_bytes >> 3));
        groups.push(plan);
    }
    memory = memory.div_ceil(1 << 30) << 30;

    let model = |p: &IoCostProfile| {
        let r = |v: f64| (v.round() as u64).max(1);
        format!(
            "{{ rbps = {}, rseqiops = {}, rrandiops = {}, wbps = {}, wseqiops = {}, wrandiops = {} }}",
            r(p.rbps),
            r(p.rseqiops),
            r(p.rrandiops),
            r(p.wbps),
            r(p.wseqiops),
            r(p.wrandiops)
        )
    };
    let k = device.speedup * f64::from(device.count);
    let emulated_cost = if is_curve {
        format!("curve = {}", vop_toml(&sim_device_curve(file, device, k)?))
    } else {
        format!("model = {}", model(&profile))
    };
    // What the scheduler charges: the emulated device's own model, unless the file picks an
    // estimator (`cost.device`), which the server then charges exactly as the simulator does.
    let (charge, capacity) = if spec.cost.device == DeviceEstimate::Node && !is_curve {
        (
            format!("{{ linear = {} }}", model(&profile)),
            1_000_000_000u64,
        )
    } else {
        let est = spec
            .cost
            .build(&n.cpu, device)
            .map_err(|e| PlanError::new(file, "cost", e))?;
        match est.device {
            DeviceModel::None => ("\"none\"".to_string(), 1_000_000_000),
            DeviceModel::Linear(m) => {
                let p = IoCostProfile {
                    rbps: m.rbps as f64 * k,
                    rseqiops: m.rseqiops as f64 * k,
                    rrandiops: m.rrandiops as f64 * k,
                    wbps: m.wbps as f64 * k,
                    wseqiops: m.wseqiops as f64 * k,
                    wrandiops: m.wrandiops as f64 * k,
                };
                (format!("{{ linear = {} }}", model(&p)), 1_000_000_000)
            }
            DeviceModel::Vop(c) => {
                let c = scale_curve(&c, k);
                let cap = DeviceModel::Vop(c.clone()).capacity_per_s();
                (format!("{{ vop = {} }}", vop_toml(&c)), cap)
            }
        }
    };
    let server_config = format!(
        "# Written by `headroom lab run` for scenario {name:?}{v}.\n\
         [storage]\nmemory = {memory}\n\n\
         [storage.emulated]\nparallelism = {parallelism}\nwrite_interference_permille = {interference}\n{emulated_cost}\n\n\
         [qos]\nworkers = {workers}\ndispatch = \"{dispatch}\"\n\n\
         [qos.capacity]\ndevice_units_per_s = {capacity}\n\n\
         [qos.cost]\ndevice = {charge}\nwrite_cost_aimd = {aimd}\n",
        name = spec.name,
        v = if variant.is_empty() {
            String::new()
        } else {
            format!(", variant {variant:?}")
        },
        workers = n.workers,
        interference = interference as u32,
        aimd = spec.cost.write_cost_aimd,
        capacity = ((capacity as f64 * capacity_scale).round() as u64).max(u64::from(n.workers)),
    );
    Ok(Plan {
        variant: variant.to_string(),
        duration: Duration::from_secs_f64(spec.duration_s),
        timeline: Duration::from_secs_f64(spec.timeline_ms / 1000.0),
        groups,
        server_config,
        not_honoured: notes,
    })
}

/// The simulated device's true cost of a measured curve, as the emulated device's VOP curve:
/// achieved IOPS (scaled by `k` = speedup x count) at each of the table's sizes and at every
/// power of two from 512 B to 1 MiB, so that between the table's points the emulated device
/// (which interpolates linearly) stays close to the simulator's log-log interpolation.
fn sim_device_curve(file: &Path, d: &DeviceSpec, k: f64) -> Result<VopCurve> {
    let curve = d
        .curve()
        .map_err(|e| PlanError::new(file, "node.devices.curve", e))?;
    let mut sizes: Vec<u64> = (9..=20).map(|p| 1u64 << p).collect();
    for p in d.curve.iter().flatten() {
        sizes.push((p.size_kib * 1024.0).round().max(1.0) as u64);
    }
    sizes.sort_unstable();
    sizes.dedup();
    let sample = |op| -> Vec<(u64, u64)> {
        sizes
            .iter()
            .map(|&s| {
                let ns = curve.cost_ns(op, s as u32, false).max(1e-3);
                (s, ((1e9 / ns) * k).round().max(1.0) as u64)
            })
            .collect()
    };
    let read = sample(OpKind::Read);
    let write = sample(OpKind::Write);
    let max_iops = read.iter().chain(&write).map(|p| p.1).max().unwrap_or(1);
    Ok(VopCurve {
        max_iops,
        read,
        write,
    })
}

/// A VOP curve with every IOPS figure multiplied by `k`.
fn scale_curve(c: &VopCurve, k: f64) -> VopCurve {
    let s = |v: u64| ((v as f64) * k).round().max(1.0) as u64;
    let pts = |p: &[(u64, u64)]| p.iter().map(|&(size, iops)| (size, s(iops))).collect();
    VopCurve {
        max_iops: s(c.max_iops),
        read: pts(&c.read),
        write: pts(&c.write),
    }
}

/// A VOP curve as the server's configuration spells it (`qos.cost.device.vop`,
/// `storage.emulated.curve`).
fn vop_toml(c: &VopCurve) -> String {
    let pts = |p: &[(u64, u64)]| {
        p.iter()
            .map(|(size, iops)| format!("[{size}, {iops}]"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{{ max_iops = {}, read = [{}], write = [{}] }}",
        c.max_iops,
        pts(&c.read),
        pts(&c.write)
    )
}

/// The device's IOCost numbers, scaled by `speedup` and `count`.
fn device_profile(
    file: &Path,
    d: &DeviceSpec,
    note: &mut impl FnMut(&str, &str),
) -> Result<IoCostProfile> {
    let base = if let Some(name) = &d.profile {
        match IoCostProfile::builtin(name) {
            Some(p) => p,
            None => {
                return fail(
                    file,
                    "node.devices.profile",
                    format!("unknown profile {name:?}"),
                );
            }
        }
    } else if let Some(p) = d.iocost {
        p
    } else if let Some(points) = &d.curve {
        // A linear fit through the first and last points: cost = base + pages x page.
        let (Some(a), Some(b)) = (points.first(), points.last()) else {
            return fail(file, "node.devices.curve", "is empty");
        };
        if b.size_kib <= a.size_kib {
            return fail(
                file,
                "node.devices.curve",
                "needs two sizes to fit a linear model",
            );
        }
        note(
            "node.devices.curve",
            "emulated as a VOP curve sampled from the simulator's device at the table's sizes and every power of two from 512 B to 1 MiB (linear between them, where the simulator interpolates log-log)",
        );
        let fit = |iops_a: f64, iops_b: f64| {
            let (pa, pb) = ((a.size_kib / 4.0).max(1.0), (b.size_kib / 4.0).max(1.0));
            let (ca, cb) = (1e9 / iops_a, 1e9 / iops_b);
            let page = ((cb - ca) / (pb - pa)).max(1.0);
            let base = (ca - pa * page).max(0.0);
            (4096.0 * 1e9 / page, 1e9 / (base + page))
        };
        let (rbps, riops) = fit(a.read_iops, b.read_iops);
        let (wbps, wiops) = fit(a.write_iops, b.write_iops);
        IoCostProfile {
            rbps,
            rseqiops: riops,
            rrandiops: riops,
            wbps,
            wseqiops: wiops,
            wrandiops: wiops,
        }
    } else {
        return fail(
            file,
            "node.devices",
            "needs one of profile, iocost or curve",
        );
    };
    let k = d.speedup * f64::from(d.count);
    if d.count > 1 {
        note(
            "node.devices.count",
            "emulated as one device count x as fast (the scheduler sees one device)",
        );
    }
    Ok(IoCostProfile {
        rbps: base.rbps * k,
        rseqiops: base.rseqiops * k,
        rrandiops: base.rrandiops * k,
        wbps: base.wbps * k,
        wseqiops: base.wseqiops * k,
        wrandiops: base.wrandiops * k,
    })
}

fn group_plan(
    file: &Path,
    spec: &ScenarioSpec,
    g: &GroupSpec,
    rng: &mut SplitMix64,
    note: &mut impl FnMut(&str, &str),
) -> Result<GroupPlan> {
    let key = |k: &str| format!("groups.{}.{k}", g.name);
    let w = &g.workload;
    if g.queues > 1 {
        note(
            &key("queues"),
            "one connection per tenant: its queues share it",
        );
    }
    if g.hot_queue_share > 0.0 {
        note(
            &key("hot_queue_share"),
            "one connection per tenant: no per-queue split",
        );
    }
    let volume_bytes = g.volume_bytes().div_ceil(512) * 512;
    let region_bytes = volume_bytes.min(REGION_CAP_BYTES);
    if volume_bytes > REGION_CAP_BYTES {
        note(
            &key("volume_gib"),
            "volumes are created at full size; I/O offsets span the first 256 MiB (RAM-backed)",
        );
    }
    let resolved = g
        .qos
        .to_volume_qos(volume_bytes)
        .map_err(|e| PlanError::new(file, &key("qos"), e))?;
    let (qos, limits) = api_qos(file, &key("qos"), &g.qos, volume_bytes, &resolved, note)?;

    let mix = SimSizeMix::from_spec(&w.sizes)
        .map_err(|e| PlanError::new(file, &key("workload.sizes"), e))?;
    let sizes = SizeMix::new(&mix.entries()).map_err(|e| {
        PlanError::new(
            file,
            &key("workload.sizes"),
            e.to_string().trim_start_matches("invalid load spec: "),
        )
    })?;
    if u64::from(sizes.max_bytes()) > region_bytes {
        return fail(
            file,
            &key("workload.sizes"),
            format!(
                "a {}-byte request does not fit the {region_bytes}-byte volume",
                sizes.max_bytes()
            ),
        );
    }
    let depth = |what: &str| -> Result<u32> {
        if w.qd > MAX_IN_FLIGHT {
            return fail(
                file,
                &key("workload.qd"),
                format!(
                    "{}: a tenant keeps at most {MAX_IN_FLIGHT} requests in flight on its connection (the server's limits.max_inflight_requests){what}",
                    w.qd
                ),
            );
        }
        Ok(w.qd)
    };
    let mode = match w.mode {
        Mode::Closed => Some(LoadMode::Closed {
            queue_depth: depth("")?,
        }),
        Mode::Open => {
            if w.population.is_some() {
                return fail(
                    file,
                    &key("workload.population"),
                    "the lab has no population model: give each group its rate",
                );
            }
            let rate = if w.rate_iops > 0.0 {
                w.rate_iops
            } else if let Some(f) = w.rate_of_baseline {
                let base = resolved.baseline.iops;
                if base == 0 || base == u64::MAX {
                    return fail(
                        file,
                        &key("workload.rate_of_baseline"),
                        "the group's QoS has no finite IOPS baseline to take a fraction of",
                    );
                }
                f * base as f64
            } else {
                return fail(
                    file,
                    &key("workload.rate_iops"),
                    "an open loop needs a rate",
                );
            };
            if !(rate.is_finite() && rate > 0.0 && rate <= 1e7) {
                return fail(
                    file,
                    &key("workload.rate_iops"),
                    format!("{rate}: the generator issues between 0 and 10^7 IOPS per tenant"),
                );
            }
            let mut cap = depth(" (open loop: the cap on outstanding requests)")?;
            if cap == 0 {
                note(
                    &key("workload.qd"),
                    &format!(
                        "0 (uncapped) in the simulator; the lab caps a tenant at {MAX_IN_FLIGHT} in flight"
                    ),
                );
                cap = MAX_IN_FLIGHT;
            }
            Some(LoadMode::Open {
                rate_iops: rate,
                arrival: match w.arrival {
                    Arrival::Poisson => ArrivalKind::Poisson,
                    Arrival::Uniform => ArrivalKind::Fixed,
                },
                max_outstanding: cap,
            })
        }
        Mode::Trace => {
            return fail(
                file,
                &key("workload.mode"),
                "\"trace\": the lab does not replay traces",
            );
        }
        Mode::Idle => None,
    };
    let mut phases = Vec::new();
    for _ in 0..g.tenants {
        let windows = w
            .active
            .iter()
            .flatten()
            .map(|[a, b]| (secs_to_ns(*a), secs_to_ns(*b)))
            .collect();
        let cycle = w.onoff.map(|o| {
            let period = o.on_s + o.off_s;
            let phase = if o.random_phase {
                rng.unit() * period
            } else {
                0.0
            };
            (secs_to_ns(o.on_s), secs_to_ns(o.off_s), secs_to_ns(phase))
        });
        phases.push(Schedule {
            windows_ns: windows,
            cycle_ns: cycle,
        });
    }
    let stats_from = g.stats_from_s.unwrap_or(spec.warmup_s);
    let stats_to = g.stats_to_s.unwrap_or(spec.duration_s).min(spec.duration_s);
    if stats_to <= stats_from {
        return fail(
            file,
            &key("stats_to_s"),
            format!("the statistics window [{stats_from}, {stats_to}) s is empty"),
        );
    }
    Ok(GroupPlan {
        name: g.name.clone(),
        tenants: g.tenants,
        volume_bytes,
        region_bytes,
        qos,
        limits,
        mode,
        sizes,
        read_permille: (w.read_fraction * 1000.0).round() as u32,
        sequential: w.pattern == Pattern::Sequential,
        phases,
        stats_from: Duration::from_secs_f64(stats_from),
        stats_to: Duration::from_secs_f64(stats_to),
    })
}

/// The API's QoS for a group, and a note wherever it resolves differently from the
/// simulator's (the API has MB/s in whole decimal units and no custom buckets).
fn api_qos(
    file: &Path,
    key: &str,
    q: &QosSpec,
    volume_bytes: u64,
    sim: &VolumeQos,
    note: &mut impl FnMut(&str, &str),
) -> Result<(ApiQos, VolumeQos)> {
    let whole = |v: Option<f64>| v.map(|v| v.round().max(0.0) as u64);
    let mbps = |v: Option<f64>| v.map(|mib| (mib * 1.048_576).round().max(1.0) as u64);
    let api = ApiQos {
        preset: q.preset.clone(),
        baseline_iops: whole(q.baseline_iops),
        baseline_mbps: mbps(q.baseline_mib_s),
        ceiling_iops: whole(q.ceiling_iops),
        ceiling_mbps: mbps(q.ceiling_mib_s),
        burst: q.burst.map(|b| match b {
            BurstSpec::None => BurstKind::None,
            BurstSpec::OnDemand => BurstKind::OnDemand,
            BurstSpec::Credits => BurstKind::Credits,
        }),
        weight: q.weight,
    };
    if q.credit_iops.is_some() || q.credit_bytes.is_some() {
        note(
            &format!("{key}.credit_iops / credit_bytes"),
            "the API sets credit buckets only through presets",
        );
    }
    if q.io_unit_kib.is_some() {
        note(
            &format!("{key}.io_unit_kib"),
            "the API has no IOPS accounting unit",
        );
    }
    if q.credit_pool.is_some() {
        note(
            &format!("{key}.credit_pool"),
            "the API has no shared credit pools",
        );
    }
    let live = api
        .resolve(volume_bytes)
        .map_err(|e| PlanError::new(file, key, format!("the API refuses this QoS: {e}")))?;
    let close = |a: u64, b: u64| a == b || (a.abs_diff(b) as f64) <= 0.01 * a.max(b) as f64;
    let same = close(live.baseline.iops, sim.baseline.iops)
        && close(live.baseline.bytes_per_s, sim.baseline.bytes_per_s)
        && close(live.ceiling.iops, sim.ceiling.iops)
        && close(live.ceiling.bytes_per_s, sim.ceiling.bytes_per_s)
        && std::mem::discriminant(&live.burst) == std::mem::discriminant(&sim.burst);
    if !same {
        note(
            key,
            &format!(
                "through the API it resolves to baseline {}/{} B/s, ceiling {}/{} B/s, burst {} (the simulator: {}/{}, {}/{}, {})",
                live.baseline.iops,
                live.baseline.bytes_per_s,
                live.ceiling.iops,
                live.ceiling.bytes_per_s,
                burst_name(&live.burst),
                sim.baseline.iops,
                sim.baseline.bytes_per_s,
                sim.ceiling.iops,
                sim.ceiling.bytes_per_s,
                burst_name(&sim.burst),
            ),
        );
    }
    Ok((api, live))
}

fn burst_name(b: &BurstMode) -> &'static str {
    match b {
        BurstMode::None => "none",
        BurstMode::OnDemand => "on-demand",
        BurstMode::Credits(_) => "credits",
    }
}

/// Seconds of a scenario file as the nanoseconds of a tenant schedule.
fn secs_to_ns(s: f64) -> u64 {
    Duration::from_secs_f64(s)
        .as_nanos()
        .try_into()
        .unwrap_or(u64::MAX)
}
