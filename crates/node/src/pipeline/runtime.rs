//! Where and how block I/O runs once the scheduler (or, without one, the arrival) lets it:
//! the executor lanes, the buffers, the emulated devices, the read router and the clock,
//! shared by every transport's requests and by the node's own work (the rebuild, the scrub).

use std::sync::Arc;

use crate::buffers::BufferPool;
use crate::clock::Clock;
use crate::exec::Lanes;

use super::emulation::Emulation;
use super::off_thread::OffThreadWork;
use super::routing::ReadRouter;

/// Where and how block I/O runs once it may run.
#[derive(Debug)]
pub struct IoRuntime {
    /// The executors, one per lane (`exec::Lane`); `None`: run everything but FLUSH inline
    /// on the calling thread.
    pub lanes: Option<Lanes>,
    /// Requests with at most this many payload bytes run inline even with an executor.
    pub inline_max_bytes: u32,
    /// Payload buffers for READ replies and WRITE data.
    pub buffers: Arc<BufferPool>,
    /// Emulated devices that decide when each request completes.
    pub emulation: Emulation,
    pub clock: Clock,
    /// For FLUSH without an executor, from threads outside the runtime too.
    pub runtime: tokio::runtime::Handle,
    /// Which copy of a replicated volume serves each read.
    pub reads: ReadRouter,
    /// The tasks handed to the lanes or the blocking pool, counted until they are gone.
    pub work: Arc<OffThreadWork>,
}
