//! What a request's completion hands back to its transport: the reply (its cookie, its body)
//! with the permits it holds until the transport has delivered it, and the statistics counted
//! as it leaves the pipeline.

use std::sync::Arc;

use headroom_nbd as nbd;
use tokio::sync::mpsc;

use crate::budget::Charge;
use crate::buffers::PooledBuffer;
use crate::metrics::{MetricsRegistry, VolumeOp, VolumeStats};
use crate::slots::SlotsTaken;

/// Permits a request holds until its reply has been written: a request slot, and for READ
/// and WRITE its buffer's bytes from the connection's and the node's budgets.
#[derive(Debug)]
pub(crate) struct Permits {
    pub(crate) _request: SlotsTaken,
    pub(crate) _bytes: Option<(SlotsTaken, Charge)>,
}

#[derive(Debug)]
pub(crate) enum ReplyBody {
    Done,
    Error(nbd::Errno, &'static str),
    Data {
        offset: u64,
        data: PooledBuffer,
    },
    /// A READ of a range that is all hole: one `NBD_REPLY_TYPE_OFFSET_HOLE` chunk, no payload.
    Hole {
        offset: u64,
        len: u32,
    },
    BlockStatus {
        extents: Vec<(u32, u32)>,
    },
}

#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) cookie: u64,
    pub(crate) body: ReplyBody,
    pub(crate) _permits: Permits,
}

type ReplySender = mpsc::UnboundedSender<Reply>;

/// Where a session's replies go, and what counts them: one `Arc` per request in flight.
#[derive(Debug)]
pub(crate) struct ReplyPath {
    pub(crate) tx: ReplySender,
    pub(crate) stats: Arc<VolumeStats>,
    pub(crate) metrics: Arc<MetricsRegistry>,
}

/// What the statistics need of a request when its reply is handed to the writer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tally {
    pub(super) op: VolumeOp,
    /// Payload bytes (READ and WRITE).
    pub(super) payload_bytes: u64,
    /// When its header was read (node clock).
    pub(super) arrival_ns: u64,
}

impl Tally {
    pub(crate) fn of(request: &nbd::ValidRequest, arrival_ns: u64) -> Option<Tally> {
        let op = VolumeOp::of(request.command)?;
        let payload_bytes = match op {
            VolumeOp::Read | VolumeOp::Write => u64::from(request.length),
            _ => 0,
        };
        Some(Tally {
            op,
            payload_bytes,
            arrival_ns,
        })
    }
}

impl ReplyPath {
    /// Hands a reply to the writer at `now_ns` and counts it (arrival to then).
    pub(crate) fn send(&self, tally: Tally, reply: Reply, now_ns: u64) {
        let failed = matches!(reply.body, ReplyBody::Error(..));
        // Counted first, so a client that has its reply finds it counted.
        self.stats.complete(
            &self.metrics,
            tally.op,
            tally.payload_bytes,
            failed,
            tally.arrival_ns,
            now_ns,
        );
        // If the writer is gone the client is gone; dropping the reply releases its permits.
        let _ = self.tx.send(reply);
    }
}
