//! Test driver: an ideal executor around a policy.
//!
//! It calls `next` until the policy says to wait, honours every `WaitUntil` exactly, completes
//! each request a fixed service time after dispatch, and checks every invariant after every
//! step. Tests then look at what was dispatched, when, and in which phase.

#![allow(dead_code)]

use headroom_qos::{
    CostVector, Decision, IoRequest, NS_PER_S, NodeCapacity, Observed, OpKind, Phase, Policy,
    PolicyKind, PolicyParams, VolumeId, VolumeQos, build_policy,
};

pub const MS: u64 = 1_000_000;
pub const S: u64 = NS_PER_S;

#[derive(Clone, Debug)]
pub struct Dispatched {
    pub at_ns: u64,
    pub req: IoRequest,
    pub phase: Phase,
}

pub struct Driver {
    pub policy: Box<dyn Policy>,
    pub now: u64,
    pub service_ns: u64,
    pub inflight: Vec<(u64, IoRequest)>,
    pub log: Vec<Dispatched>,
    pub next_id: u64,
    pub check: bool,
}

impl Driver {
    pub fn new(kind: PolicyKind, capacity: NodeCapacity) -> Self {
        Self::with_params(kind, capacity, &PolicyParams::default())
    }

    pub fn with_params(kind: PolicyKind, capacity: NodeCapacity, params: &PolicyParams) -> Self {
        Driver {
            policy: build_policy(kind, capacity, params),
            now: 0,
            service_ns: 100_000,
            inflight: Vec::new(),
            log: Vec::new(),
            next_id: 0,
            check: true,
        }
    }

    pub fn checked(&self) {
        if self.check
            && let Err(e) = self.policy.check_invariants()
        {
            panic!("at {} ns: {e}", self.now);
        }
    }

    pub fn add(&mut self, id: VolumeId, qos: &VolumeQos) {
        self.policy.add_volume(self.now, id, qos);
        self.checked();
    }

    pub fn update(&mut self, id: VolumeId, qos: &VolumeQos) {
        self.policy.update_qos(self.now, id, qos);
        self.checked();
    }

    pub fn restore(&mut self, id: VolumeId, iops_credits: Option<u64>, bytes_credits: Option<u64>) {
        self.policy
            .restore_credits(self.now, id, iops_credits, bytes_credits);
        self.checked();
    }

    pub fn remove(&mut self, id: VolumeId) {
        self.policy.remove_volume(self.now, id);
        self.checked();
    }

    /// Moves the policy to `capacity` now (the node rebalancing its workers).
    pub fn set_capacity(&mut self, capacity: NodeCapacity) {
        self.policy.set_capacity(self.now, capacity);
        self.checked();
    }

    pub fn request(
        &mut self,
        vol: VolumeId,
        op: OpKind,
        len_bytes: u32,
        cost: CostVector,
    ) -> IoRequest {
        self.next_id += 1;
        IoRequest {
            id: self.next_id,
            volume: vol,
            op,
            offset_bytes: self.next_id * 4096,
            len_bytes,
            cost,
            arrival_ns: self.now,
        }
    }

    /// Enqueues `n` requests of the same shape.
    pub fn enqueue(
        &mut self,
        vol: VolumeId,
        n: usize,
        op: OpKind,
        len_bytes: u32,
        cost: CostVector,
    ) {
        for _ in 0..n {
            let r = self.request(vol, op, len_bytes, cost);
            self.policy.enqueue(self.now, r);
            self.checked();
        }
    }

    /// Dispatches everything that may run now. Returns the policy's wake-up time.
    pub fn drain(&mut self) -> Option<u64> {
        loop {
            let d = self.policy.next(self.now);
            self.checked();
            match d {
                Decision::Dispatch(req, phase) => {
                    self.inflight
                        .push((self.now + self.service_ns, req.clone()));
                    self.log.push(Dispatched {
                        at_ns: self.now,
                        req,
                        phase,
                    });
                }
                Decision::WaitUntil(t) => {
                    assert!(
                        t > self.now,
                        "WaitUntil({t}) not in the future at {}",
                        self.now
                    );
                    return Some(t);
                }
                Decision::Idle => {
                    assert_eq!(
                        self.policy.queued_requests(),
                        0,
                        "Idle with queued requests"
                    );
                    return None;
                }
            }
        }
    }

    fn complete_due(&mut self) {
        let now = self.now;
        let mut i = 0;
        while i < self.inflight.len() {
            if self.inflight[i].0 <= now {
                let (_, req) = self.inflight.swap_remove(i);
                self.policy.complete(
                    now,
                    &req,
                    Observed {
                        service_ns: self.service_ns,
                        queue_ns: 0,
                    },
                );
                self.checked();
            } else {
                i += 1;
            }
        }
    }

    /// Completes what is due and dispatches what may run now; returns the next event: the
    /// policy's wake-up, a completion, or `other` (the caller's own next arrival), whichever
    /// comes first (`u64::MAX`: none).
    fn settle(&mut self, other: Option<u64>) -> u64 {
        self.complete_due();
        let wake = self.drain();
        let next_completion = self.inflight.iter().map(|(t, _)| *t).min();
        [wake, next_completion, other]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Runs the ideal executor until `t_end` (inclusive of events at `t_end`).
    pub fn run_until(&mut self, t_end: u64) {
        loop {
            let next = self.settle(None);
            if next > t_end {
                self.now = self.now.max(t_end);
                self.complete_due();
                let _ = self.drain();
                return;
            }
            self.now = next;
        }
    }

    /// Runs until `t_end`, keeping `vol` supplied with requests at `rate_per_s` (open loop).
    pub fn run_with_demand(
        &mut self,
        t_end: u64,
        demands: &[(VolumeId, u64, OpKind, u32, CostVector)],
    ) {
        let start = self.now;
        let mut issued: Vec<u64> = vec![0; demands.len()];
        loop {
            // Issue every arrival due by now.
            for (i, &(vol, rate, op, len, cost)) in demands.iter().enumerate() {
                while start + (issued[i] * S).div_ceil(rate.max(1)) <= self.now {
                    let r = self.request(vol, op, len, cost);
                    self.policy.enqueue(self.now, r);
                    self.checked();
                    issued[i] += 1;
                }
            }
            let next_arrival = demands
                .iter()
                .enumerate()
                .map(|(i, d)| start + (issued[i] * S).div_ceil(d.1.max(1)))
                .min();
            let next = self.settle(next_arrival);
            if next > t_end {
                self.now = self.now.max(t_end);
                return;
            }
            self.now = next;
        }
    }

    /// Runs until `t_end` keeping `qd` requests of each volume in `vols` queued or in flight
    /// (closed loop): each completion is replaced at once by the volume's next request, which
    /// `next_request(vol, k)` shapes (`k` counts the volume's requests from 0).
    pub fn run_closed_loop(
        &mut self,
        t_end: u64,
        vols: &[VolumeId],
        qd: usize,
        mut next_request: impl FnMut(VolumeId, u64) -> (OpKind, u32, CostVector),
    ) {
        let mut issued: Vec<u64> = vec![0; vols.len()];
        let outstanding = |d: &Driver, vol: VolumeId| {
            d.inflight.iter().filter(|(_, r)| r.volume == vol).count()
                + d.policy.snapshot(vol).map_or(0, |s| s.queued_requests)
        };
        loop {
            for (i, &vol) in vols.iter().enumerate() {
                for _ in outstanding(self, vol)..qd {
                    let (op, len, cost) = next_request(vol, issued[i]);
                    issued[i] += 1;
                    let r = self.request(vol, op, len, cost);
                    self.policy.enqueue(self.now, r);
                    self.checked();
                }
            }
            let next = self.settle(None);
            if next > t_end {
                self.now = self.now.max(t_end);
                return;
            }
            self.now = next;
        }
    }

    /// Bytes of `op` dispatched in `[from, to)`, all volumes.
    pub fn bytes(&self, op: OpKind, from: u64, to: u64) -> u64 {
        self.log
            .iter()
            .filter(|d| d.req.op == op && d.at_ns >= from && d.at_ns < to)
            .map(|d| u64::from(d.req.len_bytes))
            .sum()
    }

    /// Requests of `vol` dispatched in `[from, to)`.
    pub fn count(&self, vol: VolumeId, from: u64, to: u64) -> usize {
        self.log
            .iter()
            .filter(|d| d.req.volume == vol && d.at_ns >= from && d.at_ns < to)
            .count()
    }

    /// Requests of `vol` dispatched in `[from, to)` in `phase`.
    pub fn count_phase(&self, vol: VolumeId, phase: Phase, from: u64, to: u64) -> usize {
        self.log
            .iter()
            .filter(|d| d.req.volume == vol && d.phase == phase && d.at_ns >= from && d.at_ns < to)
            .count()
    }

    /// Largest wait between arrival and dispatch of `vol`'s requests in `[from, to)`.
    pub fn max_wait(&self, vol: VolumeId, from: u64, to: u64) -> u64 {
        self.log
            .iter()
            .filter(|d| d.req.volume == vol && d.at_ns >= from && d.at_ns < to)
            .map(|d| d.at_ns - d.req.arrival_ns)
            .max()
            .unwrap_or(0)
    }
}

/// A capacity of `cpu_ns_per_s` CPU and nothing else binding.
pub fn cpu_capacity(cpu_ns_per_s: u64) -> NodeCapacity {
    NodeCapacity::new(CostVector::new(cpu_ns_per_s, u64::MAX, u64::MAX, u64::MAX))
}

/// A request costing `cpu_ns` CPU and its payload.
pub fn cost(cpu_ns: u64, op: OpKind, len: u32) -> CostVector {
    let len = u64::from(len);
    CostVector::new(
        cpu_ns,
        if op == OpKind::Write { len } else { 0 },
        if op == OpKind::Read { len } else { 0 },
        0,
    )
}
