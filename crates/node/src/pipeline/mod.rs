//! The request path below every transport: permits and budget, splitting, scheduling,
//! execution against the store, completion. A transport (NBD in `node::session`, the in-memory
//! one in `node::memory_transport`, vhost-user-blk in `node::vhost_user`) parses its wire,
//! validates each request into an `nbd::ValidRequest` and hands it to its [`Intake`]; the
//! replies come back as [`Reply`] values with their [`ReplyBody`], which the transport encodes
//! for its wire and then drops, releasing the request's permits. Nothing here reads a socket or knows a framing.
//!
//! The request vocabulary is the `nbd` crate's validated request (command, offset, length,
//! flags) and its errno: a pure type, no I/O, and NBD's command set covers virtio-blk's (IN,
//! OUT, FLUSH, DISCARD, WRITE_ZEROES with or without UNMAP), so a second transport translates
//! into it rather than the pipeline growing a second one (docs/ARCHITECTURE.md, decision 52).
//!
//! One concept per file, in the order a request meets them:
//! - `intake`: a client's door — request slots, the byte budget, submission;
//! - `split`: requests larger than one backend operation, fed a few pieces at a time;
//! - `job`: what the scheduler runs (`IoJob`: a client's request or a grant for the node's own
//!   work) and how a dispatched job executes against the store, inline or on an executor lane;
//! - `block_status`: the bounded walk of allocation runs one BLOCK_STATUS answers;
//! - `runtime`, `routing`, `emulation`: where a job runs, which copy serves a read, and when an
//!   emulated device says it is done;
//! - `reply`: what goes back to the transport.

use std::sync::Arc;

use crate::budget::Budget;
use crate::limits::Limits;
use crate::metrics::MetricsRegistry;
use crate::scheduler::Scheduler;

mod block_status;
mod emulation;
mod intake;
mod job;
mod off_thread;
mod reply;
mod routing;
mod runtime;
mod split;
#[cfg(test)]
mod tests;

pub use block_status::{BLOCK_STATUS_MAX_DESCRIPTORS, BLOCK_STATUS_MAX_WALK_BYTES};
pub use emulation::Emulation;
pub(crate) use intake::{Intake, ReplyReceiver, Submission};
pub use job::{ClientJob, Grant, GrantSlot, IoJob, IoRunner, PendingGrant};
pub use off_thread::OffThreadWork;
pub(crate) use reply::{Reply, ReplyBody};
pub use routing::ReadRouter;
pub use runtime::IoRuntime;

/// What every transport's requests share on a node: its limits, where I/O runs, the
/// scheduler, the byte budget and the statistics.
#[derive(Debug)]
pub struct Pipeline {
    pub limits: Limits,
    /// Where and how requests run (shared with the scheduler's wake-up thread).
    pub io: Arc<IoRuntime>,
    /// The QoS scheduler; `None` with `--policy off` (requests run as they arrive).
    pub scheduler: Option<Arc<Scheduler<IoJob>>>,
    /// The node's payload byte budget, per tenant and in all (`node::budget`).
    pub budget: Arc<Budget>,
    /// Per-volume statistics and the promise audit (`node::metrics`).
    pub metrics: Arc<MetricsRegistry>,
}
