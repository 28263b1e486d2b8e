//! What a dispatched request carries until its completion is reported: where it ran, in
//! which phase, and how the burst gate counted it. Dispatch and volume removal make tickets,
//! completion consumes them; sessions only read them.

use std::sync::Arc;

use headroom_qos::{IoRequest, OpKind, Phase, VolumeId};

use super::IoDesc;
use super::gate::GateSlot;
use super::volume::VolumeHandle;

/// Identifies a dispatched request until its completion is reported.
#[derive(Debug)]
pub struct Ticket {
    pub(super) worker: usize,
    pub(super) request: IoRequest,
    pub(super) phase: Phase,
    pub(super) sequential: bool,
    pub(super) dispatched_ns: u64,
    /// Held back by the policy: dispatched later than by its own submission.
    pub(super) held: bool,
    /// How the burst gate counts it in flight (released at completion).
    pub(super) gate_slot: GateSlot,
    /// Counted in its volume's bursting requests at the gate (released at completion).
    pub(super) gate_burst: bool,
    /// Never dispatched by the policy: its volume was removed while it was queued.
    pub(super) orphan: bool,
    pub(super) volume: Arc<VolumeHandle>,
}

impl Ticket {
    /// When the request reached the scheduler.
    pub fn arrival_ns(&self) -> u64 {
        self.request.arrival_ns
    }

    /// When the policy let it run.
    pub fn dispatched_ns(&self) -> u64 {
        self.dispatched_ns
    }

    /// The phase it ran in.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn desc(&self) -> IoDesc {
        IoDesc {
            op: self.request.op,
            offset_bytes: self.request.offset_bytes,
            len_bytes: self.request.len_bytes,
            syncs: 0,
        }
    }

    pub fn sequential(&self) -> bool {
        self.sequential
    }
}

pub(super) fn orphan_request(id: u64, volume: VolumeId, now: u64) -> IoRequest {
    IoRequest {
        id,
        volume,
        op: OpKind::Flush,
        offset_bytes: 0,
        len_bytes: 0,
        cost: headroom_qos::CostVector::ZERO,
        arrival_ns: now,
    }
}
