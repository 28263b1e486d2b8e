//! A volume as the scheduler knows it (its handle, its per-phase counters) and its life in
//! the scheduler: registration, live QoS changes, removal, restored credit balances, and how
//! its QoS is shared between the workers.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use headroom_qos::{Phase, VolumeId, VolumeQos};

use super::config::DispatchMode;
use super::gate::GateSlot;
use super::ticket::{Ticket, orphan_request};
use super::{Ready, Scheduler};
use crate::sync::{lock, read, write};

/// Per-volume counters by phase: what an operator reads in `volume show`.
#[derive(Debug, Default)]
pub struct PhaseCounters {
    /// Requests completed, per phase in [`Phase::ALL`] order.
    pub ios: [AtomicU64; 3],
    /// Payload bytes completed, per phase.
    pub bytes: [AtomicU64; 3],
    /// Time from arrival to completion summed over requests, ns, per phase.
    pub latency_ns: [AtomicU64; 3],
    /// Requests the policy held back (dispatched later, when a timer fell due or another
    /// request's turn let them run).
    pub throttled_ios: AtomicU64,
    /// Time those requests waited for the policy, ns.
    pub throttled_ns: AtomicU64,
}

/// A snapshot of [`PhaseCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PhaseStats {
    pub ios: [u64; 3],
    pub bytes: [u64; 3],
    pub latency_ns: [u64; 3],
    pub throttled_ios: u64,
    pub throttled_ns: u64,
}

impl PhaseCounters {
    pub fn snapshot(&self) -> PhaseStats {
        let load = |a: &[AtomicU64; 3]| {
            [
                a[0].load(Ordering::Relaxed),
                a[1].load(Ordering::Relaxed),
                a[2].load(Ordering::Relaxed),
            ]
        };
        PhaseStats {
            ios: load(&self.ios),
            bytes: load(&self.bytes),
            latency_ns: load(&self.latency_ns),
            throttled_ios: self.throttled_ios.load(Ordering::Relaxed),
            throttled_ns: self.throttled_ns.load(Ordering::Relaxed),
        }
    }
}

/// A volume as the scheduler knows it; sessions keep one per connection.
#[derive(Debug)]
pub struct VolumeHandle {
    /// The store's volume id.
    pub key: u64,
    pub(super) id: VolumeId,
    pub(super) home_worker: usize,
    /// End of the last request (IOCost's sequential test).
    pub(super) last_end_bytes: AtomicU64,
    /// Spray position for 1-to-N dispatch.
    pub(super) spray: AtomicUsize,
    pub counters: PhaseCounters,
    pub(super) qos: Mutex<VolumeQos>,
    /// Bursting requests of this volume (burst requests, and baseline requests admitted while
    /// it was bursting) waiting at the burst gate or in flight: while there are any, the
    /// volume is bursting and its baseline requests take the gate too. Changed only under the
    /// gate's lock.
    pub(super) gate_burst_requests: AtomicUsize,
    /// The volume runs on its home worker only, with its whole QoS: a rate of it is too small
    /// to split over the workers (see [`too_small_to_split`]).
    pub(super) pinned: AtomicBool,
}

impl VolumeHandle {
    /// The volume's whole QoS (not a worker's share).
    pub fn qos(&self) -> VolumeQos {
        *lock(&self.qos)
    }
}

impl<J: Send + 'static> Scheduler<J> {
    /// The share of a volume's QoS one worker enforces, and on which workers. A volume
    /// [`too_small_to_split`] runs whole on its home worker, as under 1-to-1
    /// ([`Scheduler::pick_worker`] sends its requests there).
    pub(super) fn shares(&self, home: usize, qos: &VolumeQos) -> Vec<(usize, VolumeQos)> {
        let n = self.workers.len();
        match self.dispatch {
            DispatchMode::OneToOne => vec![(home, *qos)],
            DispatchMode::OneToN | DispatchMode::Stealing if too_small_to_split(qos, n as u64) => {
                vec![(home, *qos)]
            }
            DispatchMode::OneToN | DispatchMode::Stealing => {
                let share = qos.scaled(1, n as u64);
                (0..n).map(|w| (w, share)).collect()
            }
        }
    }

    /// Registers a volume (or changes its QoS if it is known) and returns its handle.
    pub fn add_volume(&self, key: u64, qos: &VolumeQos) -> Arc<VolumeHandle> {
        if let Some(handle) = self.handle(key) {
            self.update_qos(&handle, qos);
            return handle;
        }
        // Held while registering, so two sessions that meet a new volume at once register it
        // once (lock order: volumes, then a worker).
        let mut volumes = write(&self.volumes);
        if let Some(handle) = volumes.get(&key) {
            return Arc::clone(handle);
        }
        // The policies' ids are the scheduler's own, dense and never reused (4 billion volume
        // creations per process), so store ids of any size fit.
        let id = self.next_volume_id.fetch_add(1, Ordering::Relaxed);
        let handle = Arc::new(VolumeHandle {
            key,
            id,
            home_worker: (key % self.workers.len() as u64) as usize,
            last_end_bytes: AtomicU64::new(u64::MAX / 2),
            spray: AtomicUsize::new(0),
            counters: PhaseCounters::default(),
            qos: Mutex::new(*qos),
            gate_burst_requests: AtomicUsize::new(0),
            pinned: AtomicBool::new(too_small_to_split(qos, self.workers.len() as u64)),
        });
        let now = self.clock.now_ns();
        for (w, share) in self.shares(handle.home_worker, qos) {
            lock(&self.workers[w].state)
                .policy
                .add_volume(now, id, &share);
        }
        volumes.insert(key, Arc::clone(&handle));
        handle
    }

    /// The handle of a registered volume.
    pub fn handle(&self, key: u64) -> Option<Arc<VolumeHandle>> {
        read(&self.volumes).get(&key).cloned()
    }

    /// Changes a volume's QoS live: the policies keep its credit balance (clamped to a smaller
    /// bucket) and never refill it, and queued requests are judged by the new QoS at once.
    pub fn update_qos(&self, handle: &Arc<VolumeHandle>, qos: &VolumeQos) {
        *lock(&handle.qos) = *qos;
        handle.pinned.store(
            too_small_to_split(qos, self.workers.len() as u64),
            Ordering::Relaxed,
        );
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        for (w, share) in self.shares(handle.home_worker, qos) {
            let mut state = lock(&self.workers[w].state);
            state.policy.update_qos(now, handle.id, &share);
            self.drain(w, &mut state, now, &mut ready);
        }
        self.gate.admit(&mut ready, 0);
        self.run_elsewhere(ready);
    }

    /// Removes a volume; its queued requests are handed to the runner, which fails them (the
    /// volume is gone from the store by then).
    pub fn remove_volume(&self, key: u64) {
        let Some(handle) = write(&self.volumes).remove(&key) else {
            return;
        };
        let now = self.clock.now_ns();
        let mut orphans = Vec::new();
        for (w, worker) in self.workers.iter().enumerate() {
            let mut state = lock(&worker.state);
            state.policy.remove_volume(now, handle.id);
            let ids: Vec<u64> = state
                .pending
                .iter()
                .filter(|(_, p)| p.volume.key == key)
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                if let Some(p) = state.pending.remove(&id) {
                    orphans.push(Ready {
                        job: p.job,
                        ticket: Ticket {
                            worker: w,
                            request: orphan_request(id, handle.id, now),
                            phase: Phase::Baseline,
                            sequential: false,
                            dispatched_ns: now,
                            held: true,
                            gate_slot: GateSlot::Outside,
                            gate_burst: false,
                            orphan: true,
                            volume: Arc::clone(&handle),
                        },
                    });
                }
            }
            worker
                .queued
                .store(state.policy.queued_requests(), Ordering::Relaxed);
        }
        self.run_elsewhere(orphans);
    }

    /// Sets a volume's credit balances (a restart restoring saved balances), split evenly over
    /// the workers that hold a share of its QoS. Never above a bucket's capacity.
    pub fn restore_credits(&self, handle: &VolumeHandle, iops: Option<u64>, bytes: Option<u64>) {
        let now = self.clock.now_ns();
        let qos = handle.qos();
        let shares = self.shares(handle.home_worker, &qos);
        let n = shares.len() as u64;
        for (i, (w, _)) in shares.into_iter().enumerate() {
            // The first `total % n` workers get one more, so the parts add up to the total.
            let part = |total: u64| total / n + u64::from((i as u64) < total % n);
            lock(&self.workers[w].state).policy.restore_credits(
                now,
                handle.id,
                iops.map(part),
                bytes.map(part),
            );
        }
    }
}

/// Whether splitting `qos` over `workers` would round one of its finite, non-zero rates (or
/// credit refills) down to zero per worker: a ceiling of 3 IOPS over 4 workers would give each
/// 0 IOPS, and the volume would never run. Such a volume runs whole on one worker instead
/// (rounding up would let it exceed its ceiling up to `workers` times).
pub(super) fn too_small_to_split(qos: &VolumeQos, workers: u64) -> bool {
    let small = |r: u64| r > 0 && r != u64::MAX && r < workers;
    let rate_small = |r: headroom_qos::IoRate| small(r.iops) || small(r.bytes_per_s);
    let bucket_small = |b: &Option<headroom_qos::CreditBucketSpec>| {
        b.as_ref().is_some_and(|b| small(b.refill_per_s))
    };
    rate_small(qos.baseline)
        || rate_small(qos.ceiling)
        || matches!(&qos.burst, headroom_qos::BurstMode::Credits(c)
            if bucket_small(&c.iops) || bucket_small(&c.bytes))
}
