//! headroom-lab: the load generator of the lab (issue 14).
//!
//! Why a crate of its own: measuring Headroom's QoS needs load that is exactly known —
//! how many I/Os of which kind were sent, when, and how long each took — from a generator
//! whose own cost is measured too, so that a result can tell the server's limits from the
//! generator's. External tools (fio) report aggregates per job and cost a process per
//! tenant; this crate drives many tenants' load from one process with exact latency
//! histograms. It speaks NBD with the client-side codecs of `headroom-nbd` over plain TCP.
//!
//! First slice: one connection, one closed-loop group ([`closed_loop`]): a fixed queue depth
//! of pipelined random reads and writes for a fixed number of I/Os.

mod client;
mod closed_loop;
mod rng;

pub use client::{Export, LabError, NbdClient};
pub use closed_loop::{ClosedLoopSpec, GroupResult, MAX_QUEUE_DEPTH, Target, closed_loop};
pub use rng::SplitMix64;
