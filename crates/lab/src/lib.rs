//! headroom-lab: the load generator of the lab.
//!
//! Why a crate of its own: measuring Headroom's QoS needs load that is exactly known —
//! how many I/Os of which kind were sent, when, and how long each took — from a generator
//! whose own cost is measured too, so that a result can tell the server's limits from the
//! generator's. External tools (fio) report aggregates per job and cost a process per
//! tenant; this crate drives many tenants' load from one process with exact latency
//! histograms. It speaks NBD with the client-side codecs of `headroom-nbd` over plain TCP.
//!
//! * [`closed_loop`]: one connection, one closed-loop group of a fixed count (the exact-count
//!   check against the server's counters).
//! * [`run`]: many groups of tenants for a fixed time ([`engine`]), each tenant its own
//!   connection, closed loop at a queue depth or open loop at a rate ([`arrival`]), with size
//!   and read/write mixes and on/off phases ([`load`]); per-group histograms and timelines.
//!
//! And the orchestration of a lab run (`headroom lab run`): a scenario file of the simulator
//! translated into a server configuration, volumes and loads ([`plan`]), the Headroom servers
//! the run starts or targets ([`server`]) and the peers it measures beside them ([`peers`]),
//! each row driven with the same load ([`drive`]) and reported in `sim run`'s shape
//! ([`report`]), the whole run held by a [`Session`]. The API calls go through the caller's
//! client ([`api`]); the servers are processes guarded by PID ([`process`]) with scratch
//! directories of their own ([`scratch`]), their counters read from `GET /metrics`
//! ([`openmetrics`]). Failures are [`RunError`]s.
//!
//! And a second wire: [`vhost_user`], a vhost-user-blk frontend that drives a device's
//! virtqueues as a guest's driver does (the node's tests use it), with a closed-loop load
//! generator over it ([`vhost_user::load`], `headroom lab vhost-load`) for any backend's
//! socket, Headroom's or qemu-storage-daemon's.

pub mod api;
pub mod arrival;
mod client;
mod closed_loop;
pub mod drive;
pub mod engine;
mod error;
pub mod load;
pub mod openmetrics;
pub mod peers;
pub mod plan;
pub mod process;
mod replies;
pub mod report;
mod rng;
pub mod scratch;
pub mod server;
pub mod session;
pub mod vhost_user;

pub use arrival::{ArrivalKind, Arrivals};
pub use client::{Export, LabError, NbdClient};
pub use closed_loop::{ClosedLoopSpec, GroupResult, MAX_QUEUE_DEPTH, Target, closed_loop};
pub use engine::{Bucket, GroupOutcome, RunOutcome, run};
pub use error::RunError;
pub use load::{GroupLoad, LoadMode, RunPlan, Schedule, SizeMix, TenantLoad};
pub use rng::SplitMix64;
pub use session::{Row, Session, SessionSpec};
