//! The burst gate: bounds the burst work in flight so that baseline requests always find a
//! device channel (the scheduler's module doc, "The burst gate", says why and how). The rules
//! are `headroom_qos::burst_gate`'s, pure so the simulator can run them too; this file keeps
//! the waiting queues, the per-volume counts and the lock.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use headroom_qos::Phase;
pub(super) use headroom_qos::burst_gate::GateSlot;
use headroom_qos::burst_gate::{GateCounts, gate_limit};

use super::Ready;
use super::config::QosConfig;
use super::ticket::Ticket;
use crate::sync::lock;

/// Bounds the burst work in flight (module doc).
pub(super) struct BurstGate<J> {
    /// Most `Bursting` requests in flight; the gate also keeps `Bursting` + `Protected`
    /// requests in flight at most `limit + 1` when it starts a `Bursting` one (`usize::MAX`:
    /// no gate).
    pub(super) limit: usize,
    pub(super) state: Mutex<GateState<J>>,
}

pub(super) struct GateState<J> {
    pub(super) counts: GateCounts,
    /// Baseline requests of bursting volumes, released before any burst request.
    pub(super) waiting_baseline: VecDeque<Ready<J>>,
    /// Burst requests, in dispatch order.
    pub(super) waiting: VecDeque<Ready<J>>,
}

impl<J> GateState<J> {
    /// Whether one more `Bursting` request may start: burst work keeps one of the device's
    /// `limit + 1` channels for baseline work, and never makes the device queue.
    fn bursting_fits(&self, limit: usize) -> bool {
        self.counts.bursting_fits(limit)
    }

    fn start(&mut self, mut item: Ready<J>, slot: GateSlot, ready: &mut Vec<Ready<J>>) {
        self.counts.start(slot);
        item.ticket.gate_slot = slot;
        ready.push(item);
    }
}

impl<J> BurstGate<J> {
    pub(super) fn new(config: &QosConfig, device_parallelism: Option<u32>) -> Self {
        // Wild is the reference without isolation: it never gates.
        let isolates = config.policy.kind() != Some(headroom_qos::PolicyKind::Wild);
        let limit =
            gate_limit(config.burst_in_flight, device_parallelism, isolates).unwrap_or(usize::MAX);
        BurstGate {
            limit,
            state: Mutex::new(GateState {
                counts: GateCounts::default(),
                waiting_baseline: VecDeque::new(),
                waiting: VecDeque::new(),
            }),
        }
    }

    /// Passes `ready[from..]` through the gate (module doc): baseline requests of volumes that
    /// are not bursting stay; other requests stay if they fit and nothing of their class or a
    /// higher one waits, and wait otherwise.
    pub(super) fn admit(&self, ready: &mut Vec<Ready<J>>, from: usize) {
        if self.limit == usize::MAX || ready.len() <= from {
            return;
        }
        let mut gate = lock(&self.state);
        let dispatched = ready.split_off(from);
        for mut item in dispatched {
            let volume = &item.ticket.volume;
            let burst = item.ticket.phase != Phase::Baseline;
            let slot = GateSlot::of(burst, volume.gate_burst_requests.load(Ordering::Relaxed));
            if slot == GateSlot::Protected {
                gate.start(item, slot, ready);
                continue;
            }
            volume.gate_burst_requests.fetch_add(1, Ordering::Relaxed);
            item.ticket.gate_burst = true;
            let queue_empty = if burst {
                gate.waiting_baseline.is_empty() && gate.waiting.is_empty()
            } else {
                gate.waiting_baseline.is_empty()
            };
            if queue_empty && gate.bursting_fits(self.limit) {
                gate.start(item, GateSlot::Bursting, ready);
            } else if burst {
                gate.waiting.push_back(item);
            } else {
                gate.waiting_baseline.push_back(item);
            }
        }
    }

    /// A request completed: releases waiting requests while they fit.
    pub(super) fn release(&self, ticket: &Ticket, ready: &mut Vec<Ready<J>>) {
        if self.limit == usize::MAX {
            return;
        }
        let mut gate = lock(&self.state);
        gate.counts.finish(ticket.gate_slot);
        if ticket.gate_burst {
            let count = &ticket.volume.gate_burst_requests;
            count.store(
                count.load(Ordering::Relaxed).saturating_sub(1),
                Ordering::Relaxed,
            );
        }
        while gate.bursting_fits(self.limit) {
            let Some(item) = gate
                .waiting_baseline
                .pop_front()
                .or_else(|| gate.waiting.pop_front())
            else {
                break;
            };
            gate.start(item, GateSlot::Bursting, ready);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

    use headroom_qos::{PolicyKind, VolumeId, VolumeQos};

    use super::*;
    use crate::scheduler::config::PolicyChoice;
    use crate::scheduler::ticket::orphan_request;
    use crate::scheduler::{PhaseCounters, VolumeHandle};

    /// A gate of two requests, and a ready request of `volume` dispatched in `phase`.
    fn gate_of_two() -> BurstGate<u32> {
        let config = QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            burst_in_flight: Some(2),
            ..QosConfig::default()
        };
        BurstGate::new(&config, None)
    }

    fn volume(key: u64) -> Arc<VolumeHandle> {
        Arc::new(VolumeHandle {
            key,
            id: key as VolumeId,
            home_worker: 0,
            last_end_bytes: AtomicU64::new(0),
            spray: AtomicUsize::new(0),
            counters: PhaseCounters::default(),
            qos: Mutex::new(VolumeQos::default()),
            gate_burst_requests: AtomicUsize::new(0),
            pinned: AtomicBool::new(false),
        })
    }

    fn dispatched_in(volume: &Arc<VolumeHandle>, phase: Phase, job: u32) -> Ready<u32> {
        Ready {
            job,
            ticket: Ticket {
                worker: 0,
                request: orphan_request(u64::from(job), volume.id, 0),
                phase,
                sequential: false,
                dispatched_ns: 0,
                held: false,
                gate_slot: GateSlot::Outside,
                gate_burst: false,
                orphan: false,
                volume: Arc::clone(volume),
            },
        }
    }

    /// A gate of two with burst requests 1 and 2 of volume 1 running and 3 waiting; volume 2
    /// is a victim that has sent nothing yet.
    #[allow(clippy::type_complexity)]
    fn gate_full_of_burst_work() -> (
        BurstGate<u32>,
        Arc<VolumeHandle>,
        Arc<VolumeHandle>,
        Ready<u32>,
        Ready<u32>,
    ) {
        let gate = gate_of_two();
        let (burster, victim) = (volume(1), volume(2));
        let a1 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 1)).expect("room");
        let a2 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 2)).expect("room");
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 3)).is_none());
        (gate, burster, victim, a1, a2)
    }

    /// Passes one request through the gate; returns it if it may run now.
    fn admit_one(gate: &BurstGate<u32>, item: Ready<u32>) -> Option<Ready<u32>> {
        let mut ready = vec![item];
        gate.admit(&mut ready, 0);
        ready.pop()
    }

    #[test]
    fn a_bursting_volume_takes_the_gate_for_its_baseline_requests_too() {
        let (gate, burster, victim, a1, a2) = gate_full_of_burst_work();
        // The burster is bursting: its baseline request waits too, in its own queue.
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 4)).is_none());
        // A volume within its baseline passes the full gate.
        let v = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 5)).expect("baseline");
        let mut released = Vec::new();
        gate.release(&a1.ticket, &mut released);
        // The burster's baseline request goes before its waiting burst request.
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&v.ticket, &mut released);
        assert_eq!(
            released.len(),
            1,
            "two bursting requests in flight: no room"
        );
        gate.release(&a2.ticket, &mut released);
        assert_eq!(
            released.iter().map(|r| r.job).collect::<Vec<_>>(),
            vec![4, 3]
        );
        for r in released.drain(..) {
            gate.release(&r.ticket, &mut Vec::new());
        }
        // No burst request left: the burster's baseline requests pass freely again.
        assert_eq!(burster.gate_burst_requests.load(Ordering::Relaxed), 0);
        let mut held = Vec::new();
        for job in 6..9 {
            let item = dispatched_in(&burster, Phase::Baseline, job);
            held.push(admit_one(&gate, item).expect("not bursting: no wait"));
        }
        assert_eq!(lock(&gate.state).counts.protected, 3);
    }

    #[test]
    fn a_bursting_volume_stays_bursting_while_its_gated_baseline_requests_run() {
        let gate = gate_of_two();
        let burster = volume(1);
        let a1 = admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 1)).expect("room");
        let b2 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 2)).expect("room");
        assert_eq!(b2.ticket.gate_slot, GateSlot::Bursting);
        gate.release(&a1.ticket, &mut Vec::new());
        // Its burst request is done, but its baseline request admitted amid the burst is
        // still in flight: the next baseline request is bursting work too, and the gate
        // (one bursting request in flight of two) still has room for exactly one.
        let b3 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 3)).expect("room");
        assert_eq!(b3.ticket.gate_slot, GateSlot::Bursting);
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 4)).is_none());
        let mut released = Vec::new();
        gate.release(&b2.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&b3.ticket, &mut released);
        for r in released {
            gate.release(&r.ticket, &mut Vec::new());
        }
        // Nothing of it left at the gate: within its baseline again.
        let b5 = admit_one(&gate, dispatched_in(&burster, Phase::Baseline, 5)).expect("room");
        assert_eq!(b5.ticket.gate_slot, GateSlot::Protected);
    }

    #[test]
    fn baseline_work_in_flight_holds_burst_work_back_from_the_last_channel() {
        // Limit 2: a device of three channels, two of which burst work may take.
        let (gate, burster, victim, a1, a2) = gate_full_of_burst_work();
        let v1 = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 10)).expect("baseline");
        // Two bursting + one baseline in flight: the third channel is the victim's. A burst
        // completion lets the waiting burst request take its channel.
        let mut released = Vec::new();
        gate.release(&a1.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![3]);
        // A second baseline request passes a full device (it waits there for a completion,
        // not behind burst work).
        let v2 = admit_one(&gate, dispatched_in(&victim, Phase::Baseline, 11)).expect("baseline");
        assert!(admit_one(&gate, dispatched_in(&burster, Phase::BurstSpare, 4)).is_none());
        // With two baseline requests in flight, one burst completion frees no channel for
        // burst work: one bursting + two baseline fill the three channels.
        let mut released = Vec::new();
        gate.release(&a2.ticket, &mut released);
        assert!(
            released.is_empty(),
            "burst work would make the device queue"
        );
        gate.release(&v1.ticket, &mut released);
        assert_eq!(released.iter().map(|r| r.job).collect::<Vec<_>>(), vec![4]);
        gate.release(&v2.ticket, &mut Vec::new());
        let state = lock(&gate.state);
        assert_eq!((state.counts.bursting, state.counts.protected), (2, 0));
    }
}
