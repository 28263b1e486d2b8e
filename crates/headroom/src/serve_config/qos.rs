//! `[qos]` and its tables `[qos.capacity]` and `[qos.params]`: the scheduler, declared once
//! here (file name, flag, help, check, the node's [`QosConfig`] they become); the cost model,
//! `[qos.cost]`, has a file of its own.

use clap::Args;
use headroom_node::config::{DispatchMode, PolicyChoice, QosConfig};
use headroom_node::scheduler::config as qos_setting;
use headroom_qos::model::{CpuModel, DeviceModel};
use headroom_qos::{CostModel, CostVector, NS_PER_S, NodeCapacity, PolicyParams};
use merge::Merge;
use serde::Deserialize;
use serde::de::{self, Deserializer};

use super::cost::{CostSection, DeviceSection};
use super::{Invalid, Size};

/// `[qos]`: the scheduler ([`QosConfig`]).
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct QosSection {
    /// Scheduling policy: off (unscheduled), wild, base, credit, burst, mclock or drr-vop
    /// [default: burst].
    #[arg(long, value_name = "POLICY")]
    #[serde(deserialize_with = "de_policy")]
    pub policy: Option<PolicyChoice>,
    #[arg(skip)]
    pub workers: Option<usize>,
    #[arg(skip)]
    #[serde(deserialize_with = "de_dispatch")]
    pub dispatch: Option<DispatchMode>,
    #[arg(skip)]
    pub credit_save_period_ms: Option<u64>,
    #[arg(skip)]
    pub burst_in_flight: Option<u32>,
    #[arg(skip)]
    pub global_pool: Option<bool>,
    #[arg(skip)]
    #[merge(strategy = Merge::merge)]
    pub capacity: CapacitySection,
    #[arg(skip)]
    #[merge(strategy = Merge::merge)]
    pub params: ParamsSection,
    #[arg(skip)]
    #[merge(strategy = Merge::merge)]
    pub cost: CostSection,
}

/// `[qos.capacity]`: what the whole node can do per second (absent: unlimited, except CPU).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct CapacitySection {
    pub cpu_ns_per_s: Option<u64>,
    pub ingress_bytes_per_s: Option<Size>,
    pub egress_bytes_per_s: Option<Size>,
    pub device_units_per_s: Option<u64>,
}

/// `[qos.params]`: [`PolicyParams`] field by field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
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
}

impl QosSection {
    /// Checks every value that can be checked on its own.
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let q = self;
        if let Some(n) = q.workers {
            qos_setting::check_workers(n)?;
        }
        if let Some(n) = q.burst_in_flight {
            qos_setting::check_burst_in_flight(n)?;
        }
        if let Some(ms) = q.credit_save_period_ms {
            headroom_node::setting::check_credit_save_period_ms(ms)?;
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
        Ok(())
    }

    /// The table over [`QosConfig::default`], its capacities checked against the workers.
    pub(super) fn qos_config(&self) -> Result<QosConfig, Invalid> {
        let q = self;
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
