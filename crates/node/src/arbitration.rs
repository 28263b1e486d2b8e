//! The node's side of cross-node arbitration: every epoch, measure what this node's tenants
//! want of the shared backend, report it, and pace the node at the share the arbiter gave it
//! (Flint's "bandwidth auction"; the exchange is `headroom_store::arbiter`, the split
//! `headroom_qos::arbitration`).
//!
//! Why: nodes sharing one RADOS pool each pace their tenants at their own capacity and cannot
//! see one another; without a common split, one node's bursts fill the backend and another
//! node's baseline tenants wait behind them.
//!
//! **The unit.** Arbitration shares one dimension of the scheduler's cost vector, device
//! units: the binary sets a VOP cost curve (`vop_curve_for`) in which a request up to the
//! backend's bytes-per-IOPS size costs one VOP (1000 units) and a larger one costs its
//! bytes, so the backend capacity `iops × 1000` units per second bounds both IOPS and bytes.
//!
//! **Demand**, measured from the scheduler's counters over the last epoch (per second):
//! `reserved` is the sum of the baselines of the volumes that completed a request in the
//! epoch (in units: one operation per baseline IOPS, or per `bytes_per_op` of a baseline in
//! bytes, whichever is more), or the cost dispatched in the baseline phase if that is more (a
//! large request may cost more than one operation). The baselines and not only their measured use: a base-level tenant whose
//! latency grew does fewer requests, and a reservation that followed its use would shrink
//! and give the bursters on the other node more, which slows it further. `demand` is the whole cost
//! dispatched plus a quarter, at least 5 % of the backend (an idle node's tenants can start);
//! and if the node was *capacity-bound* (its policy held requests back while the node used
//! nine tenths of its share or more), `demand` is the whole backend: it can use whatever it
//! gets, and the split gives it what the others leave. Nine tenths and not the global pool's
//! three quarters: a node paced at its share uses all of it, and at ¾ a node whose fixed-rate
//! volumes were now and then held at their own limits counted as bound.
//!
//! **Fallback.** Before the first split and when no new split has been read for
//! `fallback_epochs` epochs (the arbiter died and no other took over yet, or this node cannot
//! reach the cluster), the node runs at its weighted part of the backend among the nodes of
//! the last split it saw (all of it if it never saw one). If every node falls back, the
//! parts still add up to the backend's capacity; baselines are not protected across nodes
//! then, but nothing is overcommitted.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use headroom_qos::arbitration::NodeDemand;
use headroom_qos::{CostVector, NS_PER_S};
use headroom_store::arbiter::{Arbiter, ArbiterSettings, NodeReport, NodeShare, Split};
use serde::Serialize;

use crate::scheduler::{DemandCounters, Scheduler};
use crate::sync::lock;

/// `arbitration_epoch_ms` by default.
pub const DEFAULT_EPOCH_MS: u64 = 500;
/// Epochs without a new split before a node falls back, by default.
pub const DEFAULT_FALLBACK_EPOCHS: u64 = 4;
/// Reports that missed this many splits are ignored by the arbiter.
pub const STALE_EPOCHS: u64 = 4;
/// Device units one VOP costs (milli-VOPs, `headroom_qos::model::DeviceModel::Vop`).
pub const UNITS_PER_OP: u64 = 1000;

/// How this node takes part in arbitration (`[rados] arbitration = true`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArbitrationConfig {
    /// This node's id among the nodes sharing the pool.
    pub node_id: String,
    /// Its weight in the split of what the baselines leave.
    pub weight: u64,
    pub epoch_ms: u64,
    /// The shared backend's capacity, operations per second (all nodes together).
    pub capacity_iops: u64,
    /// The shared backend's capacity in bytes per second (`None`: only IOPS count).
    pub capacity_bytes_per_s: Option<u64>,
    /// The arbiter lock's duration (`None`: four epochs, at least 2 s).
    pub lock_ms: Option<u64>,
    pub fallback_epochs: u64,
}

impl ArbitrationConfig {
    /// The backend's capacity in device units per second.
    pub fn capacity_units_per_s(&self) -> u64 {
        self.capacity_iops.saturating_mul(UNITS_PER_OP)
    }

    pub fn effective_lock_ms(&self) -> u64 {
        self.lock_ms
            .unwrap_or_else(|| self.epoch_ms.saturating_mul(4).max(2_000))
    }
}

/// The VOP curve under which one request of at most `capacity_bytes_per_s / capacity_iops`
/// bytes costs one VOP and a larger one its size in such requests (one point per direction:
/// below it the point's IOPS, beyond it constant bandwidth).
pub fn vop_curve_for(
    capacity_iops: u64,
    capacity_bytes_per_s: Option<u64>,
) -> headroom_qos::model::VopCurve {
    let iops = capacity_iops.max(1);
    // Without a bandwidth limit every request up to the largest NBD payload is one operation.
    let size = capacity_bytes_per_s.map_or(u64::from(headroom_nbd::MAX_PAYLOAD_BYTES), |b| {
        (b / iops).max(1)
    });
    headroom_qos::model::VopCurve {
        max_iops: iops,
        read: vec![(size, iops)],
        write: vec![(size, iops)],
    }
}

/// What `GET /v1/arbitration` shows.
#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct ArbitrationStatus {
    /// Arbitration is configured on this node.
    pub enabled: bool,
    pub node_id: String,
    pub weight: u64,
    pub epoch_ms: u64,
    /// The backend's capacity shared by all nodes (device units per second; 1000 per op).
    pub capacity_units_per_s: u64,
    /// The newest split this node has read (0: none yet).
    pub epoch: u64,
    /// This node holds the arbiter lock.
    pub is_arbiter: bool,
    /// The node id of the arbiter that wrote the newest split.
    pub arbiter: Option<String>,
    /// What this node reported last (units per second).
    pub reserved_units_per_s: u64,
    pub demand_units_per_s: u64,
    /// The capacity this node runs at now (units per second).
    pub share_units_per_s: u64,
    /// The node runs at its fallback share (no recent split).
    pub fallback: bool,
    /// Epochs in a row without a new split.
    pub missed_epochs: u64,
    /// The last error talking to the cluster, if the last round failed.
    pub last_error: Option<String>,
    /// Every node of the newest split.
    pub nodes: Vec<NodeShareView>,
}

/// One node in the newest split.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct NodeShareView {
    pub node_id: String,
    pub weight: u64,
    pub reserved_units_per_s: u64,
    pub demand_units_per_s: u64,
    pub share_units_per_s: u64,
}

impl From<&NodeShare> for NodeShareView {
    fn from(n: &NodeShare) -> Self {
        NodeShareView {
            node_id: n.node.clone(),
            weight: n.weight,
            reserved_units_per_s: n.reserved,
            demand_units_per_s: n.demand,
            share_units_per_s: n.share,
        }
    }
}

/// Shared between the arbitration thread and the API.
pub type SharedStatus = Arc<Mutex<ArbitrationStatus>>;

/// The arbitration thread; stopped (and the arbiter lock released) by [`Arbitration::stop`].
#[derive(Debug)]
pub struct Arbitration {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

fn grown(x: u64) -> u64 {
    x.saturating_add(x / 4)
}

/// The baselines of the volumes that completed a request since the last call, in device
/// units per second (see the module documentation); `last` keeps each volume's count.
pub fn active_baselines(
    volumes: &[(u64, headroom_qos::VolumeQos, u64)],
    last: &mut std::collections::HashMap<u64, u64>,
    bytes_per_op: u64,
) -> u64 {
    let mut sum = 0u64;
    let mut seen = std::collections::HashMap::with_capacity(volumes.len());
    for (key, qos, ios) in volumes {
        if last.get(key).is_some_and(|&before| *ios > before) {
            // An unlimited baseline in one dimension (`baseline_iops` alone leaves the bytes
            // unconstrained) promises nothing countable there: only finite ones count.
            let finite = |v: u64| (v != u64::MAX).then_some(v);
            let by_iops = finite(qos.baseline.iops).map(|v| v.saturating_mul(UNITS_PER_OP));
            let by_bytes = finite(qos.baseline.bytes_per_s)
                .map(|v| headroom_qos::cost::mul_div_floor(v, UNITS_PER_OP, bytes_per_op.max(1)));
            let units = by_iops.into_iter().chain(by_bytes).max().unwrap_or(0);
            sum = sum.saturating_add(units);
        }
        seen.insert(*key, *ios);
    }
    *last = seen;
    sum
}

/// The node's demand over an interval from two readings of the scheduler's counters, and the
/// baselines of its active volumes (units per second).
pub fn measure(
    before: DemandCounters,
    after: DemandCounters,
    elapsed_ns: u64,
    share_units_per_s: u64,
    capacity_units_per_s: u64,
    active_baseline_units_per_s: u64,
) -> NodeReport {
    let per_second = |a: CostVector, b: CostVector| {
        headroom_qos::cost::mul_div_floor(
            b.device_units.saturating_sub(a.device_units),
            NS_PER_S,
            elapsed_ns.max(1),
        )
    };
    let used = per_second(before.dispatched, after.dispatched);
    let baseline = per_second(before.baseline, after.baseline);
    let held = after.held_back > before.held_back;
    let bound = held && used >= share_units_per_s / 10 * 9;
    let demand = if bound {
        capacity_units_per_s
    } else {
        grown(used)
            .max(capacity_units_per_s / 20)
            .min(capacity_units_per_s)
    };
    let reserved = baseline
        .max(active_baseline_units_per_s)
        .min(capacity_units_per_s);
    NodeReport {
        weight: 0,
        reserved,
        demand: demand.max(reserved),
    }
}

/// The share a node runs at without a recent split: its weighted part among the nodes of
/// `last` (all of `capacity` without one, or if it is not in it).
pub fn fallback_share(capacity: u64, node_id: &str, weight: u64, last: Option<&Split>) -> u64 {
    let Some(split) = last else {
        return capacity;
    };
    let others: u64 = split
        .nodes
        .iter()
        .filter(|n| n.node != node_id)
        .map(|n| n.weight.max(1))
        .sum();
    let mine = weight.max(1);
    headroom_qos::cost::mul_div_floor(capacity, mine, mine.saturating_add(others))
}

impl Arbitration {
    /// Starts the thread: connects to the pool's arbitration object (in the background: the
    /// node serves meanwhile at its fallback share) and runs a round every epoch.
    pub fn start<J: Send + 'static>(
        config: ArbitrationConfig,
        conf: std::path::PathBuf,
        id: String,
        pool: String,
        scheduler: Arc<Scheduler<J>>,
        status: SharedStatus,
    ) -> std::io::Result<Arbitration> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("headroom-arbiter".into())
            .spawn(move || run(config, conf, id, pool, &scheduler, &status, &flag))?;
        Ok(Arbitration {
            stop,
            thread: Some(thread),
        })
    }

    pub fn stop(mut self) {
        let (flag, changed) = &*self.stop;
        *lock(flag) = true;
        changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Waits up to `period` for the stop flag; true once it is set.
fn stopped(stop: &(Mutex<bool>, Condvar), period: Duration) -> bool {
    let (flag, cv) = stop;
    let guard = lock(flag);
    let (guard, _) = cv
        .wait_timeout_while(guard, period, |stopped| !*stopped)
        .unwrap_or_else(|e| e.into_inner());
    *guard
}

fn set_share<J: Send + 'static>(scheduler: &Scheduler<J>, units_per_s: u64) {
    let mut capacity = scheduler.capacity_per_second();
    // A share of 0 would stop the node outright; one operation per second keeps it moving.
    capacity.device_units = units_per_s.max(UNITS_PER_OP);
    scheduler.set_capacity_per_second(capacity);
}

fn run<J: Send + 'static>(
    config: ArbitrationConfig,
    conf: std::path::PathBuf,
    id: String,
    pool: String,
    scheduler: &Scheduler<J>,
    status: &Mutex<ArbitrationStatus>,
    stop: &(Mutex<bool>, Condvar),
) {
    let epoch = Duration::from_millis(config.epoch_ms.max(1));
    let capacity = config.capacity_units_per_s();
    let update = |f: &mut dyn FnMut(&mut ArbitrationStatus)| {
        f(&mut lock(status));
    };
    set_share(scheduler, capacity);
    update(&mut |s| {
        s.share_units_per_s = capacity;
        s.fallback = true;
    });
    let settings = ArbiterSettings {
        conf,
        id,
        pool,
        node_id: config.node_id.clone(),
        lock_ms: config.effective_lock_ms(),
        stale_epochs: STALE_EPOCHS,
    };
    let mut arbiter = loop {
        match Arbiter::connect(settings.clone()) {
            Ok(a) => break a,
            Err(e) => {
                tracing::warn!(error = %e, "arbitration: cannot reach the pool; retrying");
                let msg = e.to_string();
                update(&mut |s| s.last_error = Some(msg.clone()));
                if stopped(stop, epoch.max(Duration::from_secs(1))) {
                    return;
                }
            }
        }
    };
    let clock = scheduler.clock();
    let mut before = scheduler.demand_counters();
    let mut before_ns = clock.now_ns();
    let mut last_split: Option<Split> = None;
    let mut seen_epoch = 0u64;
    let mut missed = 0u64;
    let mut logged_error = false;
    let mut volume_ios = std::collections::HashMap::new();
    let bytes_per_op = config
        .capacity_bytes_per_s
        .map_or(u64::from(headroom_nbd::MAX_PAYLOAD_BYTES), |b| {
            (b / config.capacity_iops.max(1)).max(1)
        });
    active_baselines(&scheduler.volume_activity(), &mut volume_ios, bytes_per_op);
    while !stopped(stop, epoch) {
        let after = scheduler.demand_counters();
        let now = clock.now_ns();
        let share_now = scheduler.capacity_per_second().device_units;
        let baselines =
            active_baselines(&scheduler.volume_activity(), &mut volume_ios, bytes_per_op);
        let mut report = measure(
            before,
            after,
            now - before_ns,
            share_now,
            capacity,
            baselines,
        );
        report.weight = config.weight;
        (before, before_ns) = (after, now);
        let outcome = arbiter.round(report, capacity, |cap, nodes| {
            let demands: Vec<NodeDemand> = nodes
                .iter()
                .map(|n| NodeDemand {
                    weight: n.weight,
                    reserved: n.reserved,
                    demand: n.demand,
                })
                .collect();
            headroom_qos::arbitration::shares(cap, &demands)
        });
        let mut is_arbiter = false;
        let mut error = None;
        match outcome {
            Ok(round) => {
                is_arbiter = round.is_arbiter;
                logged_error = false;
                match round.split {
                    Some(split) if split.epoch > seen_epoch => {
                        seen_epoch = split.epoch;
                        missed = 0;
                        last_split = Some(split);
                    }
                    _ => missed += 1,
                }
            }
            Err(e) => {
                if !logged_error {
                    tracing::warn!(error = %e, "arbitration round failed");
                    logged_error = true;
                }
                error = Some(e.to_string());
                missed += 1;
            }
        }
        let own = last_split
            .as_ref()
            .and_then(|s| s.nodes.iter().find(|n| n.node == config.node_id))
            .map(|n| n.share);
        let fallback = missed >= config.fallback_epochs.max(1) || own.is_none();
        let share = match own {
            Some(share) if !fallback => share,
            _ => fallback_share(
                capacity,
                &config.node_id,
                config.weight,
                last_split.as_ref(),
            ),
        };
        set_share(scheduler, share);
        update(&mut |s| {
            s.epoch = seen_epoch;
            s.is_arbiter = is_arbiter;
            s.arbiter = last_split.as_ref().map(|x| x.arbiter.clone());
            s.reserved_units_per_s = report.reserved;
            s.demand_units_per_s = report.demand;
            s.share_units_per_s = share;
            s.fallback = fallback;
            s.missed_epochs = missed;
            s.last_error = error.clone();
            s.nodes = last_split
                .as_ref()
                .map(|x| x.nodes.iter().map(NodeShareView::from).collect())
                .unwrap_or_default();
        });
    }
    arbiter.close();
    update(&mut |s| s.is_arbiter = false);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(dispatched: u64, baseline: u64, held_back: u64) -> DemandCounters {
        DemandCounters {
            dispatched: CostVector::new(0, 0, 0, dispatched),
            baseline: CostVector::new(0, 0, 0, baseline),
            held_back,
        }
    }

    #[test]
    fn a_capacity_bound_node_wants_the_whole_backend() {
        let cap = 10_000_000;
        // Half a second: 2M units dispatched, 0.5M in the baseline phase, held back.
        let r = measure(
            counters(0, 0, 0),
            counters(2_000_000, 500_000, 3),
            NS_PER_S / 2,
            4_000_000,
            cap,
            0,
        );
        assert_eq!(r.demand, cap);
        assert_eq!(r.reserved, 1_000_000);
        // The same without being held back: what it used plus a quarter.
        let r = measure(
            counters(0, 0, 0),
            counters(2_000_000, 500_000, 0),
            NS_PER_S / 2,
            4_000_000,
            cap,
            0,
        );
        assert_eq!(r.demand, 5_000_000);
        // Held back by a volume's own ceiling, far below the node's share: not bound.
        let r = measure(
            counters(0, 0, 0),
            counters(100_000, 0, 9),
            NS_PER_S / 2,
            4_000_000,
            cap,
            0,
        );
        assert_eq!(
            r.demand,
            cap / 20,
            "an idle-ish node asks for the 5 % floor"
        );
        assert_eq!(r.reserved, 0);
        // Active volumes' baselines are reserved even when their use is lower.
        let r = measure(
            counters(0, 0, 0),
            counters(100_000, 100_000, 0),
            NS_PER_S / 2,
            4_000_000,
            cap,
            3_000_000,
        );
        assert_eq!((r.reserved, r.demand), (3_000_000, 3_000_000));
    }

    #[test]
    fn only_volumes_that_completed_requests_count_their_baselines() {
        let qos = |iops, bytes_per_s| headroom_qos::VolumeQos {
            baseline: headroom_qos::IoRate { iops, bytes_per_s },
            ..headroom_qos::VolumeQos::default()
        };
        let mut last = std::collections::HashMap::new();
        // The first reading only records the counts.
        let v = [
            (1, qos(100, 0), 5),
            (2, qos(200, 0), 7),
            (3, qos(0, 64 << 20), 1),
        ];
        assert_eq!(active_baselines(&v, &mut last, 64 << 10), 0);
        // Volume 1 did nothing; 2 did; 3 did, and its 64 MiB/s is 1024 ops of 64 KiB.
        let v = [
            (1, qos(100, 0), 5),
            (2, qos(200, 0), 9),
            (3, qos(0, 64 << 20), 2),
        ];
        assert_eq!(
            active_baselines(&v, &mut last, 64 << 10),
            200 * UNITS_PER_OP + 1024 * UNITS_PER_OP
        );
        // `baseline_iops: 300` alone leaves the bytes unconstrained: not a promise of all.
        let v = [(4, qos(300, u64::MAX), 1), (5, qos(u64::MAX, u64::MAX), 1)];
        active_baselines(&v, &mut last, 64 << 10);
        let v = [(4, qos(300, u64::MAX), 2), (5, qos(u64::MAX, u64::MAX), 2)];
        assert_eq!(
            active_baselines(&v, &mut last, 64 << 10),
            300 * UNITS_PER_OP
        );
    }

    #[test]
    fn fallback_is_the_weighted_part_among_the_last_nodes() {
        let node = |id: &str, weight| NodeShare {
            node: id.into(),
            weight,
            reserved: 0,
            demand: 0,
            share: 0,
        };
        let split = Split {
            epoch: 7,
            arbiter: "a".into(),
            capacity: 1000,
            nodes: vec![node("a", 1), node("b", 3)],
        };
        assert_eq!(fallback_share(1000, "a", 1, Some(&split)), 250);
        assert_eq!(fallback_share(1000, "b", 3, Some(&split)), 750);
        // Not in the split yet: it counts itself in.
        assert_eq!(fallback_share(1000, "c", 1, Some(&split)), 200);
        assert_eq!(fallback_share(1000, "c", 1, None), 1000);
    }

    #[test]
    fn one_request_up_to_the_bytes_per_op_size_is_one_vop() {
        use headroom_qos::OpKind;
        // 1000 ops/s or 1000 × 64 KiB per second: 64 KiB per op.
        let curve = vop_curve_for(1000, Some(1000 * (64 << 10)));
        assert_eq!(curve.cost_milli_vops(OpKind::Read, 4096), 1000);
        assert_eq!(curve.cost_milli_vops(OpKind::Write, 64 << 10), 1000);
        assert_eq!(curve.cost_milli_vops(OpKind::Read, 256 << 10), 4000);
        let model = headroom_qos::model::DeviceModel::Vop(curve);
        assert_eq!(model.capacity_per_s(), 1_000_000);
        // Without a bandwidth limit, any request is one op.
        let curve = vop_curve_for(1000, None);
        assert_eq!(curve.cost_milli_vops(OpKind::Write, 32 << 20), 1000);
    }
}
