//! Completion: a finished request is counted for its volume, leaves the burst gate, and is
//! reported to its worker's policy and cost model; whatever that lets run is handed back.

use std::sync::atomic::Ordering;

use headroom_qos::Observed;

use super::ticket::Ticket;
use super::worker::WorkerState;
use super::{Ready, Scheduler};
use crate::sync::lock;

impl<J: Send + 'static> Scheduler<J> {
    /// Reports a completed request; appends requests that may run now to `ready`.
    pub fn complete(&self, ticket: Ticket, ready: &mut Vec<Ready<J>>) {
        self.complete_at(ticket, self.clock.now_ns(), ready);
    }

    /// [`Scheduler::complete`] with the time of completion already read from the node's
    /// clock (the session reads it once for its statistics and for this).
    pub fn complete_at(&self, ticket: Ticket, now: u64, ready: &mut Vec<Ready<J>>) {
        let payload = ticket.request.payload_bytes();
        let phase = ticket.phase as usize;
        let counters = &ticket.volume.counters;
        counters.ios[phase].fetch_add(1, Ordering::Relaxed);
        counters.bytes[phase].fetch_add(payload, Ordering::Relaxed);
        counters.latency_ns[phase].fetch_add(
            now.saturating_sub(ticket.request.arrival_ns),
            Ordering::Relaxed,
        );
        if ticket.held {
            counters.throttled_ios.fetch_add(1, Ordering::Relaxed);
            counters.throttled_ns.fetch_add(
                ticket
                    .dispatched_ns
                    .saturating_sub(ticket.request.arrival_ns),
                Ordering::Relaxed,
            );
        }
        let observed = Observed {
            service_ns: now.saturating_sub(ticket.dispatched_ns),
            queue_ns: 0,
        };
        self.gate.release(&ticket, ready);
        if ticket.orphan {
            // The policy never dispatched it (its volume is gone): nothing to report.
            return;
        }
        self.maybe_rebalance(now, ready);
        let mut state = lock(&self.workers[ticket.worker].state);
        let WorkerState {
            policy, cost_model, ..
        } = &mut *state;
        cost_model.observe(
            ticket.request.op,
            ticket.request.len_bytes,
            ticket.sequential,
            &ticket.request.cost,
            observed,
        );
        policy.complete(now, &ticket.request, observed);
        // The wake-up thread will come for a due timer; if it is late, help it.
        if now >= state.armed_ns {
            let from = ready.len();
            self.drain(ticket.worker, &mut state, now, ready);
            drop(state);
            self.gate.admit(ready, from);
        }
    }
}
