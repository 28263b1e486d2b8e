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

pub mod arrival;
mod client;
mod closed_loop;
pub mod engine;
pub mod load;
mod replies;
mod rng;

pub use arrival::{ArrivalKind, Arrivals};
pub use client::{Export, LabError, NbdClient};
pub use closed_loop::{ClosedLoopSpec, GroupResult, MAX_QUEUE_DEPTH, Target, closed_loop};
pub use engine::{Bucket, GroupOutcome, RunOutcome, run};
pub use load::{GroupLoad, LoadMode, RunPlan, Schedule, SizeMix, TenantLoad};
pub use rng::SplitMix64;
