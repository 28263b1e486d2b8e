//! The node's background scrub: every allocated extent of every volume is read below the
//! page cache and verified against its checksums, copies are compared, and what is damaged is
//! repaired from a good copy (`Volume::scrub_extent`), one 2 MiB extent at a time, paced as a
//! tenant of the QoS scheduler (`paced.rs`) at a rate the operator sets live.
//!
//! Why: a checksum finds bit rot only when the block is read, and cold data is read rarely;
//! by then the good copy may be gone as well. Walking every block regularly finds damage
//! while a good copy still exists (and, on 1-replica volumes, tells the operator which blocks
//! were lost before a client finds out). The store knows how to verify and repair one
//! extent; when to start, how fast to go and what to report is the node's.
//!
//! Schedule: a pass starts `interval_s` after the previous one began (right after it, when a
//! pass takes longer); `POST /v1/scrub` starts one now; `interval_s = 0` scrubs only on
//! demand. When the last pass began is kept in the data directory (`scrub-state.json`), so
//! a node restarted more often than the interval still scrubs on time; a new data directory
//! starts the clock (its first pass comes one interval later: it holds nothing yet). Each
//! step charges the scheduler the bytes it reads (the extent times its copies), so client
//! I/O keeps the rest of the node. A pass cut by a restart starts over from the first volume
//! when it is next due: its start is already recorded.

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use headroom_qos::OpKind;
use headroom_store::{ScrubReport, Store};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::paced::{PacedRate, step_desc};
use crate::pipeline::{IoJob, IoRuntime};
use crate::scheduler::Scheduler;
use crate::sync::lock;

/// The scrub's volume key in the scheduler (the rebuild has `u64::MAX`; store ids count up
/// from 1).
pub const SCRUB_SCHEDULER_KEY: u64 = u64::MAX - 1;

/// The rate a node scrubs at by default: 16 MiB/s, a quarter of the rebuild's (1 TiB of
/// allocated data in about 18 hours).
pub const DEFAULT_SCRUB_RATE_BYTES_PER_S: u64 = 16 << 20;

/// A pass every week by default.
pub const DEFAULT_SCRUB_INTERVAL_S: u64 = 7 * 24 * 3600;

/// Totals of what scrubs found, since the node started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ScrubTotals {
    /// Allocated logical extents scrubbed.
    pub extents_checked: u64,
    /// 4 KiB blocks read below the page cache and verified against their checksums (every
    /// copy on a device with checksums).
    pub blocks_verified: u64,
    /// Blocks of any copy that failed verification.
    pub checksum_mismatches: u64,
    /// Of those, blocks rewritten from a copy that verifies.
    pub checksum_repaired: u64,
    /// Of those, blocks no copy of which verifies: reads of them answer EIO.
    pub unrepairable: u64,
    /// 64 KiB chunks whose copies disagreed (copies on devices without checksums).
    pub copy_mismatches: u64,
    /// Of those, chunks rewritten from the majority of 3 copies.
    pub copies_repaired: u64,
}

impl ScrubTotals {
    fn add(&mut self, r: &ScrubReport) {
        self.extents_checked += r.extents_checked;
        self.blocks_verified += r.blocks_verified;
        self.checksum_mismatches += r.checksum_mismatches;
        self.checksum_repaired += r.checksum_repaired;
        self.unrepairable += r.unrepairable;
        self.copy_mismatches += r.mismatches;
        self.copies_repaired += r.repaired;
    }
}

/// A pass of the scrub, running or finished.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScrubPass {
    /// When it started, Unix seconds.
    pub started_unix_s: u64,
    /// When it finished, Unix seconds; absent while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_unix_s: Option<u64>,
    pub volumes_done: u64,
    pub volumes_total: u64,
    /// Extents scrubbed so far, of the volumes done and the one being scrubbed.
    pub extents_done: u64,
    /// What this pass found.
    pub found: ScrubTotals,
    /// Bytes read per second in this pass.
    pub bytes_per_s: u64,
}

/// Body of `GET`, `PUT` and `POST /v1/scrub`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ScrubStatus {
    /// `running` or `idle`.
    pub state: String,
    /// The rate the scrub reads at, bytes per second.
    pub rate_bytes_per_s: u64,
    /// Seconds from the start of one pass to the start of the next; 0: only on demand.
    pub interval_s: u64,
    /// Passes finished since the node started.
    pub passes_done: u64,
    /// What every scrub since the node started found (the background passes and
    /// `POST /v1/volumes/{name}/scrub`).
    pub totals: ScrubTotals,
    /// The running pass, or the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pass: Option<ScrubPass>,
}

/// The scrub task's state, shared with the API and the metrics.
#[derive(Debug)]
pub struct Scrubber {
    /// The rate, live, and the seat in the scheduler (`paced.rs`).
    pace: PacedRate,
    interval_s: u64,
    /// Where the start of the last pass is kept (`None`: nowhere; the clock starts with the
    /// node).
    state_path: Option<PathBuf>,
    state: Mutex<State>,
    /// Signalled on a wake (a pass asked for, the rate changed) and when a pass ends.
    changed: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Bumped by every wake; the task's waits end when it moves.
    generation: u64,
    /// `POST /v1/scrub` asked for a pass.
    requested: bool,
    running: bool,
    passes_done: u64,
    totals: ScrubTotals,
    pass: Option<ScrubPass>,
}

/// `scrub-state.json`.
#[derive(Debug, Serialize, Deserialize)]
struct RecordedState {
    last_pass_started_unix_s: u64,
}

fn unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Scrubber {
    /// Starts the task on its own thread. It holds the store weakly and ends when the store
    /// is gone (the node stopped). With `scheduler`, every step is a grant of the scheduler
    /// at the scrub's own rate.
    pub fn start(
        store: &Arc<Store>,
        rate_bytes_per_s: u64,
        interval_s: u64,
        state_path: Option<PathBuf>,
        scheduler: Option<(Arc<IoRuntime>, Arc<Scheduler<IoJob>>)>,
    ) -> std::io::Result<Arc<Scrubber>> {
        let me = Arc::new(Scrubber {
            pace: PacedRate::new(rate_bytes_per_s, SCRUB_SCHEDULER_KEY, scheduler),
            interval_s,
            state_path,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        // Read (or started) here, before the thread, so the schedule is set when this returns.
        let first_due = (interval_s > 0).then(|| {
            let due_unix_s = me.last_pass_started_unix_s() + interval_s;
            Instant::now() + Duration::from_secs(due_unix_s.saturating_sub(unix_s()))
        });
        let task = Arc::clone(&me);
        let store = Arc::downgrade(store);
        std::thread::Builder::new()
            .name("headroom-scrub".into())
            .spawn(move || task.run(&store, first_due))?;
        Ok(me)
    }

    pub fn rate_bytes_per_s(&self) -> u64 {
        self.pace.rate_bytes_per_s()
    }

    /// Changes the rate live (at least 1 byte/s); a running pass follows from its next extent.
    pub fn set_rate(&self, rate_bytes_per_s: u64) {
        self.pace.set(rate_bytes_per_s);
        self.wake(false);
    }

    /// Starts a pass now, unless one runs (then nothing changes).
    pub fn request_pass(&self) {
        self.wake(true);
    }

    /// Counts a scrub the API ran on one volume (`POST /v1/volumes/{name}/scrub`).
    pub fn record(&self, report: &ScrubReport) {
        lock(&self.state).totals.add(report);
    }

    pub fn totals(&self) -> ScrubTotals {
        lock(&self.state).totals
    }

    pub fn passes_done(&self) -> u64 {
        lock(&self.state).passes_done
    }

    pub fn view(&self) -> ScrubStatus {
        let st = lock(&self.state);
        ScrubStatus {
            state: if st.running { "running" } else { "idle" }.into(),
            rate_bytes_per_s: self.rate_bytes_per_s(),
            interval_s: self.interval_s,
            passes_done: st.passes_done,
            totals: st.totals,
            pass: st.pass.clone(),
        }
    }

    /// Waits until at least `passes` passes have finished or `timeout` passed; the view then.
    pub fn wait_for_passes(&self, passes: u64, timeout: Duration) -> ScrubStatus {
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.state);
        while st.passes_done < passes {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(st);
        self.view()
    }

    fn wake(&self, request: bool) {
        let mut st = lock(&self.state);
        st.generation += 1;
        st.requested |= request;
        drop(st);
        self.changed.notify_all();
    }

    /// Waits until `deadline` (`None`: until woken) or a wake, whichever first.
    fn wait_until(&self, deadline: Option<Instant>) {
        let mut st = lock(&self.state);
        let seen = st.generation;
        while st.generation == seen {
            let wait = match deadline {
                None => Duration::from_secs(1),
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(Duration::from_secs(1)),
                    _ => return,
                },
            };
            st = self
                .changed
                .wait_timeout(st, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if deadline.is_none() {
                return; // re-checks the store and the request once a second
            }
        }
    }

    /// When the last pass began, Unix seconds, as recorded; records now when nothing is.
    fn last_pass_started_unix_s(&self) -> u64 {
        let recorded = self.state_path.as_ref().and_then(|path| {
            let text = std::fs::read_to_string(path).ok()?;
            serde_json::from_str::<RecordedState>(&text).ok()
        });
        match recorded {
            Some(state) => state.last_pass_started_unix_s,
            None => {
                let now = unix_s();
                self.record_pass_start(now);
                now
            }
        }
    }

    /// Records the start of a pass (a temporary file renamed over the old one). A failure is
    /// logged: it costs only an early pass after a restart.
    fn record_pass_start(&self, started_unix_s: u64) {
        let Some(path) = &self.state_path else { return };
        let text = serde_json::to_string(&RecordedState {
            last_pass_started_unix_s: started_unix_s,
        })
        .unwrap_or_default();
        let tmp = path.with_extension("json.tmp");
        if let Err(e) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)) {
            tracing::warn!(path = %path.display(), error = %e, "could not record the scrub's last pass");
        }
    }

    fn run(&self, store: &Weak<Store>, first_due: Option<Instant>) {
        let interval = (self.interval_s > 0).then(|| Duration::from_secs(self.interval_s));
        let mut next_pass = first_due;
        loop {
            if store.strong_count() == 0 {
                return;
            }
            let requested = std::mem::take(&mut lock(&self.state).requested);
            let due = next_pass.is_some_and(|at| Instant::now() >= at);
            if requested || due {
                let began = Instant::now();
                self.record_pass_start(unix_s());
                if !self.pass(store) {
                    return;
                }
                next_pass = interval.map(|every| began + every);
                continue;
            }
            self.wait_until(next_pass);
        }
    }

    /// One pass over every volume; false when the node stopped meanwhile. The store (and a
    /// volume) is held only while one extent is scrubbed, never while waiting.
    fn pass(&self, weak: &Weak<Store>) -> bool {
        let Some(store) = weak.upgrade() else {
            return false;
        };
        let volumes = store.list_volumes();
        drop(store);
        {
            let mut st = lock(&self.state);
            st.running = true;
            st.pass = Some(ScrubPass {
                started_unix_s: unix_s(),
                volumes_total: volumes.len() as u64,
                ..ScrubPass::default()
            });
        }
        tracing::info!(volumes = volumes.len(), "scrub pass started");
        let mut pacer = self.pace.pacer();
        for info in volumes {
            let extents = {
                let Some(store) = weak.upgrade() else {
                    return false;
                };
                match store.open_volume(&info.name) {
                    Ok(volume) => volume.allocated_extents(),
                    Err(_) => Vec::new(), // deleted meanwhile
                }
            };
            let copies = u64::from(info.replicas.max(1));
            for extent in extents {
                let bytes = headroom_store::EXTENT_SIZE_BYTES * copies;
                let Some(turn) = pacer.turn(
                    step_desc(OpKind::Read, extent, bytes),
                    || self.rate_bytes_per_s(),
                    |due| self.wait_until(Some(due)),
                    || weak.strong_count() > 0,
                ) else {
                    return false;
                };
                let Some(store) = weak.upgrade() else {
                    return false;
                };
                let outcome = store
                    .open_volume(&info.name)
                    .and_then(|volume| volume.scrub_extent(extent));
                drop(store);
                pacer.done(turn, bytes);
                let mut st = lock(&self.state);
                match outcome {
                    Ok(report) => {
                        if report.checksum_mismatches > 0 || report.mismatches > 0 {
                            tracing::warn!(
                                volume = %info.name, extent, ?report,
                                "scrub found damage"
                            );
                        }
                        st.totals.add(&report);
                        if let Some(pass) = st.pass.as_mut() {
                            pass.found.add(&report);
                            pass.extents_done += 1;
                            pass.bytes_per_s = pacer.bytes_per_s();
                        }
                    }
                    Err(e) => {
                        // Deleted or shrunk meanwhile, or a device error: the rest of the
                        // volume waits for the next pass.
                        tracing::debug!(volume = %info.name, extent, error = %e, "scrub of an extent skipped");
                        break;
                    }
                }
            }
            if let Some(pass) = lock(&self.state).pass.as_mut() {
                pass.volumes_done += 1;
            }
        }
        let mut st = lock(&self.state);
        st.running = false;
        st.passes_done += 1;
        if let Some(pass) = st.pass.as_mut() {
            pass.finished_unix_s = Some(unix_s());
            tracing::info!(
                extents = pass.extents_done,
                found = ?pass.found,
                "scrub pass done"
            );
        }
        drop(st);
        self.changed.notify_all();
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests panic on failure by design

    use std::os::unix::fs::FileExt as _;

    use super::*;
    use headroom_store::{NewVolume, StoreConfig};

    /// A file pool of two devices in `dir` (checksums on: signed file devices).
    fn file_store(dir: &std::path::Path) -> Arc<Store> {
        Arc::new(
            Store::open(&StoreConfig {
                device_count: 2,
                device_capacity_bytes: 64 << 20,
                ..StoreConfig::new(dir)
            })
            .unwrap(),
        )
    }

    /// Flips one byte of block `block` of `volume`'s copy `replica` of extent 0 in the device
    /// file, behind the store's back.
    fn damage(store: &Store, dir: &std::path::Path, volume: &str, replica: u8, block: u64) {
        let v = store.open_volume(volume).unwrap();
        let at = v.replica_location(replica, 0).unwrap();
        let path = &store.pool_info().devices[at.device as usize].path;
        let path = if std::path::Path::new(path).is_absolute() {
            std::path::PathBuf::from(path)
        } else {
            dir.join(path)
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let pos = at.offset_bytes + block * 4096 + 100;
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, pos).unwrap();
        byte[0] ^= 0x10;
        file.write_all_at(&byte, pos).unwrap();
    }

    /// The schedule survives restarts: a recorded pass start an interval ago makes a pass
    /// due at once; a new state file starts the clock (no pass until an interval later).
    #[test]
    fn a_pass_is_due_an_interval_after_the_recorded_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(dir.path());
        let state = dir.path().join("scrub-state.json");
        let long_ago = unix_s() - 3600;
        std::fs::write(
            &state,
            format!("{{\"last_pass_started_unix_s\":{long_ago}}}"),
        )
        .unwrap();
        let due = Scrubber::start(&store, 1 << 30, 600, Some(state.clone()), None).unwrap();
        assert_eq!(
            due.wait_for_passes(1, Duration::from_secs(60)).passes_done,
            1
        );
        let recorded: RecordedState =
            serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
        assert!(
            recorded.last_pass_started_unix_s >= long_ago + 3600,
            "{recorded:?}"
        );
        drop(due);

        let fresh = dir.path().join("fresh-state.json");
        let later = Scrubber::start(&store, 1 << 30, 600, Some(fresh.clone()), None).unwrap();
        // The clock started: recorded now, the first pass an interval away (one asked for
        // runs at once).
        let recorded: RecordedState =
            serde_json::from_str(&std::fs::read_to_string(&fresh).unwrap()).unwrap();
        assert!(
            recorded.last_pass_started_unix_s + 60 > unix_s(),
            "{recorded:?}"
        );
        assert_eq!(later.view().state, "idle");
        later.request_pass();
        assert_eq!(
            later
                .wait_for_passes(1, Duration::from_secs(60))
                .passes_done,
            1
        );
    }

    /// A pass asked for through `request_pass` verifies every allocated block of every
    /// volume: a flipped block of a 1-replica volume is reported unrepairable, one of a
    /// 2-replica volume is repaired (and a second pass finds nothing).
    #[test]
    fn a_pass_verifies_every_block_and_repairs_from_the_good_copy() {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(dir.path());
        store.create_volume("one", 8 << 20).unwrap();
        store
            .create_volume_with(
                "two",
                8 << 20,
                NewVolume {
                    replicas: 2,
                    ..NewVolume::default()
                },
            )
            .unwrap();
        for name in ["one", "two"] {
            let v = store.open_volume(name).unwrap();
            v.write_at(0, &[0x5a; 64 << 10], false).unwrap();
            v.flush().unwrap();
        }
        damage(&store, dir.path(), "one", 0, 3);
        damage(&store, dir.path(), "two", 1, 7);
        // interval 0: only on demand; no scheduler: paced by itself, fast.
        let scrub = Scrubber::start(&store, 1 << 30, 0, None, None).unwrap();
        assert_eq!(scrub.view().state, "idle");
        scrub.request_pass();
        let view = scrub.wait_for_passes(1, Duration::from_secs(60));
        assert_eq!(view.passes_done, 1, "{view:?}");
        let found = view.pass.unwrap().found;
        // One extent each; 512 blocks per copy verified: 512 + 2 × 512.
        assert_eq!(found.extents_checked, 2, "{found:?}");
        assert_eq!(found.blocks_verified, 3 * 512, "{found:?}");
        assert_eq!(found.checksum_mismatches, 2, "{found:?}");
        assert_eq!(found.checksum_repaired, 1, "{found:?}");
        assert_eq!(found.unrepairable, 1, "{found:?}");
        scrub.request_pass();
        let view = scrub.wait_for_passes(2, Duration::from_secs(60));
        let again = view.pass.unwrap().found;
        assert_eq!(
            (again.checksum_mismatches, again.unrepairable),
            (1, 1),
            "the repaired copy stays repaired, the lost block stays lost: {again:?}"
        );
        assert_eq!(view.totals.checksum_mismatches, 3);
    }
}
