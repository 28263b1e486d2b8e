//! Building a [`Node`] for one run: devices, the capacity the policies are told about, workers,
//! tenants and their groups.
//!
//! Kept apart from the event handlers in `node.rs` because it is configuration, run once per
//! (variant, policy): which device a byte lands on, what budget a policy schedules against,
//! how each tenant's load is drawn. The random draws made here (population levels, on/off
//! phases) come in a fixed order, group by group and tenant by tenant, so that a seed still
//! names exactly one run; keep that order when changing this file.

use super::rebuild::{RebuildStats, Rebuilds};
use super::{
    Divisor, GroupRun, NONE, NS_PER_S_F, Node, PolicyChoice, Tenant, TimelineBucket, Worker,
    f64_to_cap, secs_to_ns,
};
use crate::device::Device;
use crate::error::SimError;
use crate::event_queue::EventQueue;
use crate::fifo::Fifo;
use crate::histogram::Histogram;
use crate::link::Link;
use crate::rng::{STREAM_NODE, STREAM_POPULATION, STREAM_TENANT_BASE, SimRng};
use crate::scenario::{GroupSpec, NodeSpec, ReadRouting, ScenarioSpec};
use crate::trace::TraceRecord;
use crate::workload::{Arrival, Mode, OnOffSpec, Pattern, Schedule, SizeMix, WorkloadSpec};
use headroom_qos::{
    CostModel, CostVector, NodeCapacity, Policy, PolicyKind, PolicyParams, VolumeId, VolumeQos,
    build_policy,
};
use std::collections::VecDeque;
use std::path::Path;
use std::str::FromStr;

impl<'a> Node<'a> {
    /// The node of `spec` running `choice` on every worker, all random streams derived from
    /// `seed`; trace paths are relative to `base_dir`. Every tenant's volume is registered
    /// with the policies at time 0.
    pub(crate) fn build(
        spec: &'a ScenarioSpec,
        base_dir: &Path,
        choice: PolicyChoice,
        seed: u64,
    ) -> Result<Node<'a>, SimError> {
        let n = &spec.node;
        let backend = Backend::build(n)?;
        let cost_model = spec.cost.build(&n.cpu, &n.devices[0])?;
        let capacity = worker_capacity(n, &cost_model, &backend);
        let workers = build_workers(spec, choice, seed, capacity, &cost_model);
        let clock = RunClock::of(spec);
        let population = Population::build(spec, base_dir, seed, backend.sets, &clock)?;

        let rebuild_enabled = spec.actions.iter().any(|a| a.rebuild.is_some());
        let tenant_count = population.tenants.len();
        let stripe_bytes = n.stripe_kib.saturating_mul(1024).max(4096);
        let mut node = Node {
            spec,
            seed,
            policy_name: choice.name(),
            q: EventQueue::with_capacity(tenant_count * 2 + 1024),
            workers,
            tenants: population.tenants,
            groups: population.groups,
            group_qos: population.group_qos,
            slots: Vec::new(),
            free_head: NONE,
            ingress: Link::new(n.nic.ingress_bytes_per_s),
            egress: Link::new(n.nic.egress_bytes_per_s),
            devices: backend.devices,
            sets_div: Divisor::new(backend.sets as u64),
            stripe_div: Divisor::new(stripe_bytes),
            replicas: backend.replicas,
            read_routing: n.replication.map_or(ReadRouting::Primary, |r| r.reads),
            replica_loads: Vec::new(),
            stripe_bytes,
            cpu: n.cpu,
            node_rng: SimRng::new(seed, STREAM_NODE),
            dispatch: n.dispatch,
            timeline_ns: clock.timeline_ns,
            timeline_bucket: 0,
            timeline_bucket_end_ns: clock.timeline_ns,
            phase_timeline: vec![[0; 3]; clock.buckets],
            end_ns: clock.end_ns,
            warmup_ns: clock.warmup_ns,
            completed: 0,
            violations: 0,
            first_violation: None,
            next_volume: 0,
            rebuild_enabled,
            rb: Box::new(Rebuilds::new(rebuild_enabled, tenant_count)),
        };
        // Volume ids 0..tenants are the initial volumes; replacements take the next ones.
        node.next_volume = node.tenants.len() as VolumeId;
        node.register_volumes(0);
        Ok(node)
    }
}

/// The backend devices as one flat list: replica set `s` is devices `s * replicas ..
/// (s + 1) * replicas`. A scenario lists device kinds with counts; the node addresses devices
/// by index, and replication needs the list to split evenly into sets.
struct Backend {
    devices: Vec<Device>,
    /// Devices per replica set (1 without replication).
    replicas: usize,
    /// Number of replica sets (data is striped over them).
    sets: usize,
}

impl Backend {
    /// Every device of every kind, `count` times each, in scenario order.
    fn build(n: &NodeSpec) -> Result<Backend, SimError> {
        let mut devices = Vec::new();
        for d in &n.devices {
            let curve = d.curve()?;
            for _ in 0..d.count {
                devices.push(Device::new(d, curve.clone()));
            }
        }
        let replicas = n.replication.map_or(1, |r| r.factor as usize);
        if devices.len() % replicas != 0 {
            return Err(SimError::Invalid(format!(
                "{} devices cannot be split into replica sets of {replicas}",
                devices.len()
            )));
        }
        let sets = devices.len() / replicas;
        Ok(Backend {
            devices,
            replicas,
            sets,
        })
    }
}

/// The capacity each worker's policy is told it has: one worker's share of the node's CPU,
/// NIC and devices, scaled by `capacity.scale`, unless the scenario sets a dimension outright.
/// The policies schedule against a per-worker budget, as in the server, where the node's
/// capacity is split evenly over its workers.
fn worker_capacity(n: &NodeSpec, cost_model: &CostModel, backend: &Backend) -> NodeCapacity {
    let c = &n.capacity;
    let w = n.workers as f64;
    let scaled = |v: f64| f64_to_cap(v * c.scale);
    let per_device = cost_model.device.capacity_per_s();
    // Replicas serve the same data, so only one device per set adds capacity.
    let device_units_total = if per_device == u64::MAX {
        f64::INFINITY
    } else {
        per_device as f64 * backend.devices.len() as f64 / backend.replicas as f64
    };
    let nic_cap = |rate: f64| {
        if rate > 0.0 {
            scaled(rate / w)
        } else {
            u64::MAX
        }
    };
    NodeCapacity::new(CostVector::new(
        c.cpu_ns_per_s
            .map_or_else(|| scaled(NS_PER_S_F), f64_to_cap),
        c.ingress_bytes_per_s
            .map_or_else(|| nic_cap(n.nic.ingress_bytes_per_s), f64_to_cap),
        c.egress_bytes_per_s
            .map_or_else(|| nic_cap(n.nic.egress_bytes_per_s), f64_to_cap),
        c.device_units_per_s
            .map_or_else(|| scaled(device_units_total / w), f64_to_cap),
    ))
}

/// One worker per configured thread, each with its own policy instance and its own copy of
/// the cost model: workers schedule and learn costs independently, as the server's do.
fn build_workers(
    spec: &ScenarioSpec,
    choice: PolicyChoice,
    seed: u64,
    capacity: NodeCapacity,
    cost_model: &CostModel,
) -> Vec<Worker> {
    (0..spec.node.workers as usize)
        .map(|i| {
            let policy = worker_policy(spec, choice, seed, i, capacity);
            Worker::new(policy, cost_model.clone())
        })
        .collect()
}

/// Worker `index`'s scheduler. Each policy gets its own seed, so that the workers' random
/// choices do not march in step; policies the scenario lists as uncapped get no capacity.
fn worker_policy(
    spec: &ScenarioSpec,
    choice: PolicyChoice,
    seed: u64,
    index: usize,
    capacity: NodeCapacity,
) -> Box<dyn Policy> {
    match choice {
        PolicyChoice::Fifo => Box::new(Fifo::default()),
        PolicyChoice::Qos(kind) => {
            let mut params: PolicyParams = spec.policy_params;
            params.seed = seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index as u64 + 1));
            let uncapped = spec
                .uncapped_policies
                .iter()
                .any(|p| PolicyKind::from_str(p).ok() == Some(kind));
            let cap = if uncapped {
                NodeCapacity::UNLIMITED
            } else {
                capacity
            };
            build_policy(kind, cap, &params)
        }
    }
}

impl Worker {
    /// An idle worker with an empty ring and zeroed counters.
    fn new(policy: Box<dyn Policy>, cost_model: CostModel) -> Worker {
        Worker {
            policy,
            cost_model,
            busy: false,
            idle: false,
            wake_at_ns: u64::MAX,
            wake_generation: 0,
            ring: VecDeque::new(),
            ops: 0,
            busy_ns: 0,
            steals: 0,
            stolen: 0,
            waits: 0,
            idles: 0,
            past_waits: 0,
        }
    }
}

/// The run's time frame, in ns, and the number of timeline buckets it spans.
struct RunClock {
    end_ns: u64,
    warmup_ns: u64,
    timeline_ns: u64,
    buckets: usize,
}

impl RunClock {
    /// The frame of `spec`: `duration_s`, `warmup_s` and buckets of `timeline_ms`.
    fn of(spec: &ScenarioSpec) -> RunClock {
        let end_ns = secs_to_ns(spec.duration_s);
        let timeline_ns = ((spec.timeline_ms * 1e6).round() as u64).max(1);
        RunClock {
            end_ns,
            warmup_ns: secs_to_ns(spec.warmup_s),
            timeline_ns,
            buckets: end_ns.div_ceil(timeline_ns) as usize,
        }
    }
}

/// Every tenant of the node, and per group its accumulators and QoS, in scenario order (a
/// tenant's index is its initial volume id and names its random stream).
struct Population {
    tenants: Vec<Tenant>,
    groups: Vec<GroupRun>,
    group_qos: Vec<VolumeQos>,
}

impl Population {
    /// The tenants of `spec`'s groups; each tenant's data gets its own region on every
    /// device set (`device_sets` of them).
    fn build(
        spec: &ScenarioSpec,
        base_dir: &Path,
        seed: u64,
        device_sets: usize,
        clock: &RunClock,
    ) -> Result<Population, SimError> {
        let mut p = Population {
            tenants: Vec::new(),
            groups: Vec::with_capacity(spec.groups.len()),
            group_qos: Vec::with_capacity(spec.groups.len()),
        };
        // One stream for every population draw of the run, taken tenant by tenant.
        let mut pop_rng = SimRng::new(seed, STREAM_POPULATION);
        let mut region_base_bytes = 0u64;
        for (gi, g) in spec.groups.iter().enumerate() {
            let sizes = SizeMix::from_spec(&g.workload.sizes)?;
            let qos = g.qos.to_volume_qos(g.volume_bytes())?;
            let traces = load_traces(g, base_dir)?;
            let count = if g.workload.mode == Mode::Trace {
                traces.len()
            } else {
                g.tenants as usize
            };
            let group = GroupBuild {
                index: gi as u32,
                spec: g,
                qos,
            };
            let mut traces = traces.into_iter();
            for _ in 0..count {
                let global_index = p.tenants.len() as u32;
                let tenant = new_tenant(
                    &group,
                    global_index,
                    seed,
                    &mut pop_rng,
                    traces.next(),
                    region_base_bytes,
                )?;
                p.tenants.push(tenant);
                // Each tenant's data gets its own region on every device set, 64 MiB apart.
                region_base_bytes = region_base_bytes
                    .saturating_add(g.volume_bytes().div_ceil(device_sets as u64) + (64 << 20));
            }
            p.groups.push(GroupRun::new(spec, g, sizes, count, clock));
            p.group_qos.push(qos);
        }
        Ok(p)
    }
}

/// A trace group's per-device record lists, one per tenant to create (at most `max_devices`,
/// else at most `tenants` when set); empty for other groups. Traces are read here, at build
/// time, so that a missing file fails the run before it starts.
fn load_traces(g: &GroupSpec, base_dir: &Path) -> Result<Vec<Vec<TraceRecord>>, SimError> {
    let wl = &g.workload;
    let (Mode::Trace, Some(t)) = (&wl.mode, &wl.trace) else {
        return Ok(Vec::new());
    };
    let path = base_dir.join(&t.path);
    let trace = crate::trace::load(&path, t.format)?;
    let mut devs: Vec<Vec<TraceRecord>> = trace.devices.into_iter().map(|d| d.records).collect();
    let limit = if t.max_devices > 0 {
        t.max_devices
    } else if g.tenants > 0 {
        g.tenants as usize
    } else {
        devs.len()
    };
    devs.truncate(limit);
    Ok(devs)
}

/// One group as its tenants are built from it.
struct GroupBuild<'s> {
    index: u32,
    spec: &'s GroupSpec,
    qos: VolumeQos,
}

/// Tenant `global_index` of `group`: its own random stream, its load (drawn from `pop_rng`
/// when the group has a population), its on/off schedule, and its trace records if any.
fn new_tenant(
    group: &GroupBuild<'_>,
    global_index: u32,
    seed: u64,
    pop_rng: &mut SimRng,
    trace: Option<Vec<TraceRecord>>,
    region_base_bytes: u64,
) -> Result<Tenant, SimError> {
    let g = group.spec;
    let wl = &g.workload;
    let mut rng = SimRng::new(seed, STREAM_TENANT_BASE + u64::from(global_index));
    let (rate_iops, cycle) = offered_load(g, &group.qos, pop_rng)?;
    let schedule = Schedule {
        windows_ns: active_windows_ns(wl),
        cycle_ns: cycle.map(|c| onoff_ns(c, &mut rng)),
    };
    let (trace, trace_speed) = match (&wl.trace, trace) {
        (Some(t), Some(recs)) => (recs, t.speed.max(1e-9)),
        _ => (Vec::new(), 1.0),
    };
    Ok(Tenant {
        volume: global_index,
        group: group.index,
        global_index,
        mode: wl.mode,
        qd: wl.qd,
        gap_mean_ns: if rate_iops > 0.0 {
            NS_PER_S_F / rate_iops
        } else {
            f64::INFINITY
        },
        uniform_gaps: wl.arrival == Arrival::Uniform,
        read_fraction: wl.read_fraction,
        sequential: wl.pattern == Pattern::Sequential,
        cursor_bytes: 0,
        last_end_bytes: u64::MAX / 2,
        volume_bytes: g.volume_bytes(),
        region_base_bytes,
        schedule,
        on: false,
        arrival_generation: 0,
        outstanding: 0,
        backlog: 0,
        rng,
        queues: g.queues,
        hot_share: g.hot_queue_share,
        spray: global_index,
        trace,
        trace_arrive: 0,
        trace_issue: 0,
        trace_speed,
        ops: 0,
        bytes: 0,
        lat_sum_ns: 0,
        issued: 0,
        dropped: 0,
        device_ns: 0.0,
    })
}

/// A tenant's open-loop rate (IOPS) and on/off cycle: the workload's, a multiple of the
/// baseline (`rate_of_baseline`), or drawn from the group's population, which sets both
/// (bursting tenants get the population's tail cycle, the others run steadily).
fn offered_load(
    g: &GroupSpec,
    qos: &VolumeQos,
    pop_rng: &mut SimRng,
) -> Result<(f64, Option<OnOffSpec>), SimError> {
    let wl = &g.workload;
    let mut rate = wl.rate_iops;
    let mut cycle = wl.onoff;
    if let Some(f) = wl.rate_of_baseline {
        rate = f * qos.baseline.iops as f64;
    }
    if let Some(p) = &wl.population {
        let load = p.draw(pop_rng);
        let base = if qos.baseline.iops == 0 || qos.baseline.iops == u64::MAX {
            return Err(SimError::Invalid(format!(
                "group {}: a population needs a finite baseline_iops",
                g.name
            )));
        } else {
            qos.baseline.iops as f64
        };
        rate = load.level * base;
        cycle = if load.bursting {
            Some(p.tail_onoff)
        } else {
            None
        };
    }
    Ok((rate, cycle))
}

/// The workload's `active` windows in ns, sorted.
fn active_windows_ns(wl: &WorkloadSpec) -> Vec<(u64, u64)> {
    wl.active
        .as_ref()
        .map(|ws| {
            let mut v: Vec<(u64, u64)> = ws
                .iter()
                .map(|w| (secs_to_ns(w[0]), secs_to_ns(w[1])))
                .collect();
            v.sort_unstable();
            v
        })
        .unwrap_or_default()
}

/// `(on, off, phase)` of an on/off cycle in ns; the phase is drawn from the tenant's stream
/// when `random_phase` is set, so that tenants of one group do not burst in lockstep.
fn onoff_ns(c: OnOffSpec, rng: &mut SimRng) -> (u64, u64, u64) {
    let on = secs_to_ns(c.on_s).max(1);
    let off = secs_to_ns(c.off_s);
    let phase = if c.random_phase {
        rng.below(on + off)
    } else {
        0
    };
    (on, off, phase)
}

impl GroupRun {
    /// The empty accumulators of group `g` with `tenants` tenants. Its statistics window is
    /// `stats_from_s..stats_to_s` (default: warm-up to end); billing starts with one volume
    /// per tenant for the whole run.
    fn new(
        spec: &ScenarioSpec,
        g: &GroupSpec,
        sizes: SizeMix,
        tenants: usize,
        clock: &RunClock,
    ) -> GroupRun {
        GroupRun {
            name: g.name.clone(),
            sizes,
            from_ns: g.stats_from_s.map_or(clock.warmup_ns, secs_to_ns),
            to_ns: g
                .stats_to_s
                .map_or(clock.end_ns, secs_to_ns)
                .min(clock.end_ns),
            hist: Histogram::new(),
            ops: 0,
            bytes: 0,
            phase_ops: [0; 3],
            timeline: vec![TimelineBucket::default(); clock.buckets],
            sched_wait_ns: 0,
            downstream_wait_ns: 0,
            volumes_created: tenants as u64,
            provisioned_gib_s: tenants as f64 * g.volume_gib * spec.duration_s,
            rebuild: spec
                .actions
                .iter()
                .any(|a| a.group == g.name && a.rebuild.is_some())
                .then(RebuildStats::default),
        }
    }
}
