//! The scheduler's settings (`[qos]`): which policy runs, how requests reach workers, the
//! node's capacity and the policy's parameters. Here, beside the scheduler that reads them,
//! so that the request path does not depend on the node's whole configuration.

use headroom_qos::{CostModel, CostVector, NS_PER_S, NodeCapacity, PolicyKind, PolicyParams};
use serde::{Deserialize, Serialize};

use crate::setting::{InvalidSetting, count};

/// Which scheduler runs the I/O, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyChoice {
    /// No scheduler: requests run in arrival order, unlimited (the path before QoS; kept for
    /// comparison).
    Off,
    /// One of the shipped policies.
    #[serde(untagged)]
    Policy(PolicyKind),
}

impl PolicyChoice {
    /// The policy, if any.
    pub fn kind(self) -> Option<PolicyKind> {
        match self {
            PolicyChoice::Off => None,
            PolicyChoice::Policy(kind) => Some(kind),
        }
    }
}

impl std::fmt::Display for PolicyChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyChoice::Off => f.write_str("off"),
            PolicyChoice::Policy(kind) => write!(f, "{kind}"),
        }
    }
}

impl std::str::FromStr for PolicyChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(PolicyChoice::Off);
        }
        s.parse::<PolicyKind>()
            .map(PolicyChoice::Policy)
            .map_err(|_| {
                format!("unknown policy {s:?}: expected off, wild, base, credit, burst, mclock or drr-vop")
            })
    }
}

/// How a request finds its scheduler worker (BurstCBS's mapping of queues to threads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DispatchMode {
    /// Requests are sprayed round robin over the workers, one by one; each worker enforces
    /// 1/N of every volume's QoS over 1/N of the node's capacity.
    #[default]
    OneToN,
    /// Every request of a volume goes to the volume's home worker, which enforces its whole
    /// QoS over 1/N of the node's capacity (a busy volume cannot use the other workers).
    OneToOne,
    /// A request goes to its volume's home worker unless that worker has a backlog and another
    /// has none: then it goes to the idle one. Each worker enforces 1/N of every volume's QoS.
    Stealing,
}

impl std::str::FromStr for DispatchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "one-to-n" | "1-to-n" | "1ton" => Ok(DispatchMode::OneToN),
            "one-to-one" | "1-to-1" | "1to1" => Ok(DispatchMode::OneToOne),
            "stealing" | "work-stealing" => Ok(DispatchMode::Stealing),
            _ => Err(format!(
                "unknown dispatch mode {s:?}: expected one-to-n, one-to-one or stealing"
            )),
        }
    }
}

/// The scheduler's configuration: which policy, over what capacity, with how many workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QosConfig {
    pub policy: PolicyChoice,
    /// Tunables of the policies (`track_invariants` is on in debug builds only).
    pub params: PolicyParams,
    /// What the whole node can do per second; each worker gets `1/workers` of it.
    pub capacity: NodeCapacity,
    /// Estimates each request's cost vector (CPU, ingress, egress, device units).
    pub cost_model: CostModel,
    /// Scheduler workers (each runs its own policy instance).
    pub workers: usize,
    pub dispatch: DispatchMode,
    /// Requests that may be in flight at the device (dispatched, not completed) before a
    /// request above its baseline waits for a completion (`node::scheduler`, "burst gate").
    /// `None`: the emulated device's parallelism minus one (one channel kept free for
    /// baseline requests), no gate without an emulated device; `Some(0)`: no gate.
    pub burst_in_flight: Option<u32>,
    /// Moves capacity between workers every policy window by what they used
    /// (`headroom_qos::global_pool`); `false`: each worker keeps `1/workers` of the node.
    pub global_pool: bool,
}

impl Default for QosConfig {
    /// `burst` over [`QosConfig::default_capacity`] with two workers sprayed 1-to-N.
    fn default() -> Self {
        let workers = 2;
        QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            params: QosConfig::server_params(),
            capacity: QosConfig::default_capacity(workers),
            cost_model: CostModel::new(
                headroom_qos::model::CpuModel::default(),
                headroom_qos::model::DeviceModel::None,
            ),
            workers,
            dispatch: DispatchMode::OneToN,
            burst_in_flight: None,
            global_pool: true,
        }
    }
}

impl QosConfig {
    /// The policy parameters a server runs with: the library's defaults, with invariant
    /// tracking (verification, not scheduling: no decision reads it) in debug builds only, so
    /// every debug server and in-process test is checked as the simulator is and a release
    /// build pays nothing (`Scheduler::check_invariants`), and with a 1 ms node pacer depth so
    /// that a wake-up that comes tens of µs late does not lose capacity
    /// (`PolicyParams::pacer_depth_ns`).
    pub fn server_params() -> PolicyParams {
        PolicyParams {
            track_invariants: cfg!(debug_assertions),
            pacer_depth_ns: 1_000_000,
            ..PolicyParams::default()
        }
    }

    /// A capacity that is safe on any machine: one CPU-second per second per worker (a worker
    /// cannot do more than that), no network or device limit (neither is known before
    /// `headroom calibrate` has measured them). With it the scheduler enforces every volume's
    /// baseline and ceiling and never holds the node below what its CPUs can do.
    pub fn default_capacity(workers: usize) -> NodeCapacity {
        let workers = u64::try_from(workers.max(1)).unwrap_or(u64::MAX);
        NodeCapacity::new(CostVector::new(
            NS_PER_S.saturating_mul(workers),
            u64::MAX,
            u64::MAX,
            u64::MAX,
        ))
    }
}

/// Most scheduler workers a configuration may ask for.
pub const MAX_WORKERS: usize = 64;
/// Most burst requests in flight per device the burst gate may allow.
pub const MAX_BURST_IN_FLIGHT: u32 = 65_536;

/// `qos.workers`: 1 to [`MAX_WORKERS`].
pub fn check_workers(n: usize) -> Result<(), InvalidSetting> {
    if !(1..=MAX_WORKERS).contains(&n) {
        return Err(InvalidSetting::new(
            "qos.workers",
            count(n),
            format!("must be between 1 and {MAX_WORKERS}"),
        ));
    }
    Ok(())
}

/// `qos.burst_in_flight`: at most [`MAX_BURST_IN_FLIGHT`] (0 turns the gate off).
pub fn check_burst_in_flight(n: u32) -> Result<(), InvalidSetting> {
    if n > MAX_BURST_IN_FLIGHT {
        return Err(InvalidSetting::new(
            "qos.burst_in_flight",
            u64::from(n),
            format!("must be at most {MAX_BURST_IN_FLIGHT} requests (0 turns the burst gate off)"),
        ));
    }
    Ok(())
}

impl QosConfig {
    /// Runs the rules of the scheduler's own settings.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        check_workers(self.workers)?;
        if let Some(n) = self.burst_in_flight {
            check_burst_in_flight(n)?;
        }
        Ok(())
    }
}
