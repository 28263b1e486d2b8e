//! Which copy of a replicated volume serves each read, on a live node.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use headroom_qos::routing::{ReadRouting, ReplicaLoad, route_read};
use headroom_store::Volume;

/// Read routing over a replicated volume's copies (`[storage] read_routing`): the policy is
/// `headroom_qos::routing::route_read` (FAST's type-aware routing with stealing, or a
/// baseline), the same code the simulator routes with; this is its state on a live node.
///
/// A device's load is the number of routed reads on it not yet answered (with an emulated
/// device, until the device says they are done). Writes are not counted: they go to every
/// copy alike, so they load every copy's device the same and do not change which is idler.
#[derive(Debug)]
pub struct ReadRouter {
    routing: ReadRouting,
    /// Advanced per routed read (round robin).
    turn: AtomicU64,
    /// Routed reads in flight, per pool device id.
    in_flight: Box<[AtomicU32]>,
}

/// Where a read was routed: the copy it tries first and that copy's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Routed {
    pub(super) copy: u8,
    pub(super) device: u32,
}

impl ReadRouter {
    pub fn new(routing: ReadRouting) -> ReadRouter {
        ReadRouter {
            routing,
            turn: AtomicU64::new(0),
            in_flight: (0..headroom_store::MAX_DEVICES)
                .map(|_| AtomicU32::new(0))
                .collect(),
        }
    }

    /// The routing policy.
    pub fn routing(&self) -> ReadRouting {
        self.routing
    }

    /// Routes a read at `offset` of `volume` (the copies of its first extent decide) and
    /// counts it in flight on the chosen copy's device until [`ReadRouter::done`]. `None` for
    /// a 1-replica volume and for a hole: the store reads as it always does.
    ///
    /// The router's "replica 0, 1, 2" are the copies in the order of their devices' ids, not
    /// the copies' numbers: placement puts copy 0 of different extents on different devices,
    /// so routing by copy number would send random and sequential reads to every device
    /// alike. By device order, the lowest-numbered device holding a copy serves the random
    /// reads and the next one the sequential reads, for every extent the two share (FAST's
    /// head and middle replica).
    pub(super) fn route(&self, volume: &Volume, offset: u64, sequential: bool) -> Option<Routed> {
        if volume.replicas() <= 1 {
            return None;
        }
        let copies = volume.copies(offset / headroom_store::EXTENT_SIZE_BYTES);
        // (device, copy number, healthy), in device order.
        let mut order = [(u32::MAX, 0u8, false); headroom_store::MAX_REPLICAS as usize];
        let mut n = 0;
        for (copy, slot) in copies.iter().enumerate() {
            if let Some((location, healthy)) = slot {
                order[n] = (location.device, u8::try_from(copy).ok()?, *healthy);
                n += 1;
            }
        }
        let order = &mut order[..n];
        order.sort_unstable();
        let mut loads = [ReplicaLoad::default(); headroom_store::MAX_REPLICAS as usize];
        for (load, &(device, _, healthy)) in loads.iter_mut().zip(order.iter()) {
            *load = ReplicaLoad {
                healthy,
                in_flight: self.counter(device)?.load(Ordering::Relaxed),
            };
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let pick = route_read(self.routing, sequential, turn, &loads[..n])?;
        let (device, copy, _) = *order.get(pick)?;
        self.counter(device)?.fetch_add(1, Ordering::Relaxed);
        Some(Routed { copy, device })
    }

    /// The routed read on `device` is answered.
    pub(super) fn done(&self, device: u32) {
        if let Some(c) = self.counter(device) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn counter(&self, device: u32) -> Option<&AtomicU32> {
        self.in_flight.get(usize::try_from(device).ok()?)
    }
}
