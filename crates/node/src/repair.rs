//! The node's rebuild task: when a device fails, the lost copies of replicated volumes are
//! copied again onto healthy devices (`Volume::rebuild_extent`, one 2 MiB extent at a time),
//! at a rate the operator sets live (`PUT /v1/rebuild`), with its progress in the API, the
//! CLI and the metrics. Why a module of its own: the store only knows how to repair one
//! extent; deciding when to start, how fast to go and what to report is the node's.
//!
//! Pacing (`paced.rs`): with a QoS scheduler the rebuild is a tenant of it, registered under
//! [`REBUILD_SCHEDULER_KEY`] at a fixed rate of `rate_bytes_per_s`, and every extent copy
//! waits for a grant of its size; without one the task paces itself at the same rate. See
//! docs/ARCHITECTURE.md (rebuild decision).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use headroom_qos::{OpKind, VolumeQos};
use headroom_store::{RebuildStep, Store, VolumeHealth};

use crate::paced::{PacedRate, fixed_rate_qos, step_desc};
use crate::pipeline::{IoJob, IoRuntime};
use crate::scheduler::Scheduler;
use crate::sync::lock;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The rebuild rate a node starts with: 64 MiB/s (a 100 GiB copy set in about 27 minutes),
/// well under a disk's sequential bandwidth so client I/O keeps most of the device.
pub const DEFAULT_REBUILD_RATE_BYTES_PER_S: u64 = 64 << 20;

/// The rebuild's volume key in the scheduler (no store volume has it: store ids count up
/// from 1).
pub const REBUILD_SCHEDULER_KEY: u64 = u64::MAX;

/// Read and write errors after which the task fails a device (`[storage.rebuild]
/// fail_device_after_errors`).
pub const DEFAULT_FAIL_DEVICE_AFTER_ERRORS: u64 = 16;

/// The scheduler QoS of a rebuild at `rate_bytes_per_s` (`paced::fixed_rate_qos`).
pub fn rebuild_qos(rate_bytes_per_s: u64) -> VolumeQos {
    fixed_rate_qos(rate_bytes_per_s)
}

/// How often the task looks for degraded volumes when nothing wakes it.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// A volume's rebuild, as `volume show` and `GET /v1/rebuild` show it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RebuildProgress {
    pub volume: String,
    /// `running`, `done`, `waiting` (no healthy device with a free extent outside the
    /// extent's other copies: the volume stays degraded) or `lost` (some extent has no copy
    /// left on a healthy device).
    pub state: String,
    pub extents_done: u64,
    pub extents_total: u64,
    /// Bytes copied per second since this rebuild started (or the rate last changed).
    pub bytes_per_s: u64,
    /// Why it is not running, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Body of `GET` and `PUT /v1/rebuild`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RebuildView {
    /// The rate the rebuild is paced at, bytes per second.
    pub rate_bytes_per_s: u64,
    /// Bytes copied by rebuilds since the node started.
    pub bytes_total: u64,
    /// Lost copies (extents) still to rebuild, every volume.
    pub extents_remaining: u64,
    /// The latest rebuild of each volume that needed one since the node started.
    pub volumes: Vec<RebuildProgress>,
}

/// The rebuild task's state, shared with the API.
#[derive(Debug)]
pub struct Rebuilder {
    /// The rate, live, and the seat in the scheduler (`paced.rs`).
    pace: PacedRate,
    bytes_total: AtomicU64,
    extents_remaining: AtomicU64,
    /// By volume name.
    progress: Mutex<BTreeMap<String, RebuildProgress>>,
    /// Read and write errors after which a device is failed (0: never).
    fail_device_after_errors: u64,
    /// Bumped by `wake` (a device failed, the rate changed); the task waits on it.
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Rebuilder {
    /// Starts the task on its own thread. It holds the store weakly and ends when the store
    /// is gone (the node stopped).
    /// With `scheduler`, every copy is a grant of the scheduler at the rebuild's own QoS.
    pub fn start(
        store: &Arc<Store>,
        rate_bytes_per_s: u64,
        fail_device_after_errors: u64,
        scheduler: Option<(Arc<IoRuntime>, Arc<Scheduler<IoJob>>)>,
    ) -> std::io::Result<Arc<Rebuilder>> {
        let me = Arc::new(Rebuilder {
            fail_device_after_errors,
            pace: PacedRate::new(rate_bytes_per_s, REBUILD_SCHEDULER_KEY, scheduler),
            bytes_total: AtomicU64::new(0),
            extents_remaining: AtomicU64::new(0),
            progress: Mutex::new(BTreeMap::new()),
            generation: Mutex::new(0),
            changed: Condvar::new(),
        });
        let task = Arc::clone(&me);
        let store = Arc::downgrade(store);
        std::thread::Builder::new()
            .name("headroom-rebuild".into())
            .spawn(move || task.run(&store))?;
        Ok(me)
    }

    pub fn rate_bytes_per_s(&self) -> u64 {
        self.pace.rate_bytes_per_s()
    }

    /// Changes the rate live (at least 1 byte/s); the running copy follows from its next extent.
    pub fn set_rate(&self, rate_bytes_per_s: u64) {
        self.pace.set(rate_bytes_per_s);
        self.wake();
    }

    /// Whether the copies go through the QoS scheduler.
    pub fn scheduled(&self) -> bool {
        self.pace.scheduled()
    }

    /// Makes the task look for work now (a device was failed).
    pub fn wake(&self) {
        *lock(&self.generation) += 1;
        self.changed.notify_all();
    }

    pub fn bytes_total(&self) -> u64 {
        self.bytes_total.load(Ordering::Relaxed)
    }

    pub fn extents_remaining(&self) -> u64 {
        self.extents_remaining.load(Ordering::Relaxed)
    }

    /// The latest rebuild of volume `name`, if it needed one since the node started.
    pub fn progress(&self, name: &str) -> Option<RebuildProgress> {
        lock(&self.progress).get(name).cloned()
    }

    pub fn view(&self) -> RebuildView {
        RebuildView {
            rate_bytes_per_s: self.rate_bytes_per_s(),
            bytes_total: self.bytes_total(),
            extents_remaining: self.extents_remaining(),
            volumes: lock(&self.progress).values().cloned().collect(),
        }
    }

    /// Waits until `deadline` or a `wake`, whichever first.
    fn wait_until(&self, deadline: Instant) {
        let mut generation = lock(&self.generation);
        let seen = *generation;
        while *generation == seen {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            generation = self
                .changed
                .wait_timeout(generation, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn run(&self, store: &Weak<Store>) {
        loop {
            self.pass(store);
            self.wait_until(Instant::now() + POLL_INTERVAL);
            if store.strong_count() == 0 {
                return;
            }
        }
    }

    /// Fails, for good, every device whose reads and writes failed
    /// `fail_device_after_errors` times or more since it entered service (its start, or
    /// `headroom device restore`). ENOSPC is not counted: a full filesystem is not a broken
    /// device (the store counts it apart, `DeviceOpStats::no_space`).
    fn fail_erring_devices(&self, store: &Store) {
        let limit = self.fail_device_after_errors;
        if limit == 0 {
            return;
        }
        let failed: Vec<bool> = store.pool_info().devices.iter().map(|d| d.failed).collect();
        for (id, stats) in store.device_stats().iter().enumerate() {
            let errors = stats.errors_in_service;
            if errors < limit || failed.get(id).copied().unwrap_or(true) {
                continue;
            }
            let Ok(id) = u32::try_from(id) else { continue };
            match store.fail_device(id) {
                Ok(_) => {
                    tracing::warn!(device = id, errors, limit, "device failed after I/O errors");
                    self.wake();
                }
                Err(e) => {
                    tracing::debug!(device = id, error = %e, "could not fail an erring device")
                }
            }
        }
    }

    /// One look at every replicated volume: rebuilds the lost copies of each degraded one.
    /// The store (and a volume, which holds the store's state) is held only while one extent
    /// is copied, never while waiting, so a node that stops is not kept from closing its
    /// store cleanly by a slow rebuild.
    fn pass(&self, weak: &Weak<Store>) {
        let Some(store) = weak.upgrade() else { return };
        self.fail_erring_devices(&store);
        let degraded: Vec<_> = store
            .list_volumes()
            .into_iter()
            .filter(|v| v.replicas > 1 && v.health != VolumeHealth::Healthy)
            .collect();
        let mut remaining = 0u64;
        for info in &degraded {
            let Ok(volume) = store.open_volume(&info.name) else {
                continue;
            };
            remaining += volume.extents_to_rebuild().len() as u64;
        }
        self.extents_remaining.store(remaining, Ordering::Relaxed);
        drop(store);
        for info in degraded {
            let Some(store) = weak.upgrade() else { return };
            let Ok(volume) = store.open_volume(&info.name) else {
                continue;
            };
            let todo = volume.extents_to_rebuild();
            if todo.is_empty() {
                continue;
            }
            let mut progress = RebuildProgress {
                volume: info.name.clone(),
                state: "running".into(),
                extents_total: todo.len() as u64,
                ..RebuildProgress::default()
            };
            let previous = lock(&self.progress).insert(info.name.clone(), progress.clone());
            let changed = previous.as_ref().is_none_or(|p| p.state != "waiting");
            if changed {
                tracing::info!(volume = %info.name, extents = todo.len(), "rebuild started");
            }
            volume.set_rebuilding(true);
            drop((volume, store));
            let mut pacer = self.pace.pacer();
            for extent in todo {
                let desc = step_desc(OpKind::Write, extent, headroom_store::EXTENT_SIZE_BYTES);
                let Some(turn) = pacer.turn(
                    desc,
                    || self.rate_bytes_per_s(),
                    |due| self.wait_until(due),
                    || weak.strong_count() > 0,
                ) else {
                    return; // the node stopped
                };
                let Some(store) = weak.upgrade() else { return };
                let Ok(volume) = store.open_volume(&info.name) else {
                    pacer.done(turn, 0);
                    break; // deleted meanwhile
                };
                let step = volume.rebuild_extent(extent);
                drop((volume, store));
                let copied = match step {
                    Ok(RebuildStep::Rebuilt { bytes }) => bytes,
                    _ => 0,
                };
                pacer.done(turn, copied);
                match step {
                    Ok(RebuildStep::Rebuilt { bytes }) => {
                        self.bytes_total.fetch_add(bytes, Ordering::Relaxed);
                        progress.extents_done += 1;
                    }
                    Ok(RebuildStep::Complete) => progress.extents_done += 1,
                    Ok(RebuildStep::NoPlacement) => {
                        progress.state = "waiting".into();
                        progress.reason = Some(
                            "no healthy device with a free extent outside the extent's other \
                             copies: add a device"
                                .into(),
                        );
                        break;
                    }
                    Ok(RebuildStep::Lost) => {
                        progress.state = "lost".into();
                        progress.reason =
                            Some(format!("extent {extent} has no copy on a healthy device"));
                    }
                    Err(e) => {
                        tracing::warn!(volume = %info.name, extent, error = %e, "rebuild of an extent failed; retrying later");
                        progress.state = "waiting".into();
                        progress.reason = Some(format!("extent {extent}: {e}"));
                        break;
                    }
                }
                self.extents_remaining
                    .store(remaining.saturating_sub(1), Ordering::Relaxed);
                remaining = remaining.saturating_sub(1);
                progress.bytes_per_s = pacer.bytes_per_s();
                lock(&self.progress).insert(info.name.clone(), progress.clone());
            }
            if progress.state == "running" {
                progress.state = "done".into();
                tracing::info!(volume = %info.name, extents = progress.extents_done, "rebuild done");
            }
            if let Some(volume) = weak.upgrade().and_then(|s| s.open_volume(&info.name).ok()) {
                volume.set_rebuilding(false);
            }
            lock(&self.progress).insert(info.name.clone(), progress);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests panic on failure by design

    use super::*;
    use headroom_store::{FaultConfig, FaultRule, FaultScope, NewVolume};

    #[test]
    fn a_device_whose_reads_keep_failing_is_failed_for_good() {
        let store = Arc::new(Store::open_memory(64 << 20).unwrap());
        store
            .create_volume_with(
                "m",
                16 << 20,
                NewVolume {
                    replicas: 2,
                    ..NewVolume::default()
                },
            )
            .unwrap();
        let volume = store.open_volume("m").unwrap();
        volume.write_at(0, &[9u8; 4096], false).unwrap();
        let mut rule = FaultRule::new(FaultScope::Device(0));
        rule.eio_read_permille = 1000;
        store
            .inject_faults(&FaultConfig {
                seed: 1,
                rules: vec![rule],
            })
            .unwrap();
        // Every read tries device 0's copy first, fails there, and is served by the other.
        let first = volume
            .copies(0)
            .iter()
            .position(|c| c.is_some_and(|(l, _)| l.device == 0))
            .unwrap();
        let rebuilder = Rebuilder::start(&store, 1 << 20, 4, None).unwrap();
        let mut buf = [0u8; 4096];
        for read in 1..=4 {
            rebuilder.fail_erring_devices(&store);
            assert!(
                !store.pool_info().devices[0].failed,
                "failed after {read} errors"
            );
            volume
                .read_at_from(0, &mut buf, u8::try_from(first).unwrap())
                .unwrap();
            assert_eq!(buf, [9u8; 4096]);
        }
        rebuilder.fail_erring_devices(&store);
        let pool = store.pool_info();
        assert!(pool.devices[0].failed && !pool.devices[1].failed);
        assert_eq!(volume.info().health, VolumeHealth::Degraded);
        // A limit of 0 never fails a device.
        let never = Rebuilder::start(&store, 1 << 20, 0, None).unwrap();
        never.fail_erring_devices(&store);
        assert!(!store.pool_info().devices[1].failed);
    }

    /// ENOSPC is a full filesystem, not a broken device: 40 write failures with ENOSPC on a
    /// device do not fail it at a limit of 4. And a device restored after its errors starts
    /// counting again from zero, so the task does not fail it again at once.
    #[test]
    fn enospc_never_fails_a_device_and_a_restored_device_counts_from_zero() {
        let store = Arc::new(Store::open_memory(64 << 20).unwrap());
        store.create_volume("v", 16 << 20).unwrap();
        let volume = store.open_volume("v").unwrap();
        volume.write_at(0, &[1u8; 4096], false).unwrap();
        let device = volume.extent_location(0).unwrap().device;
        let mut full = FaultRule::new(FaultScope::Device(device));
        full.enospc_write_permille = 1000;
        let mut other = FaultRule::new(FaultScope::Device(1 - device));
        other.eio_write_permille = 1000;
        store
            .inject_faults(&FaultConfig {
                seed: 1,
                rules: vec![full, other],
            })
            .unwrap();
        for _ in 0..40 {
            assert!(volume.write_at(0, &[2u8; 4096], false).is_err());
        }
        let rebuilder = Rebuilder::start(&store, 1 << 20, 4, None).unwrap();
        rebuilder.fail_erring_devices(&store);
        assert!(
            !store.pool_info().devices[device as usize].failed,
            "ENOSPC failed the device"
        );
        // The other device's writes fail with EIO: failed after 4.
        let on_other = store
            .create_volume("w", 16 << 20)
            .and_then(|_| store.open_volume("w"));
        let w = on_other.unwrap();
        let mut eio = 0;
        for i in 0..8u64 {
            if w.write_at(i * (2 << 20), &[3u8; 4096], false).is_err() {
                eio += 1;
            }
        }
        assert!(eio >= 4, "{eio}");
        rebuilder.fail_erring_devices(&store);
        let other = (1 - device) as usize;
        assert!(store.pool_info().devices[other].failed);
        let restored = store.restore_device(other as u32).unwrap();
        assert!(restored.restored);
        rebuilder.fail_erring_devices(&store);
        assert!(
            !store.pool_info().devices[other].failed,
            "failed again at once for the errors before the restore"
        );
    }
}
