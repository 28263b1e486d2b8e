//! What the node measures about each volume, independent of the scheduler: operations,
//! payload bytes, errors and latency per NBD operation, and the promise audit (`audit`).
//!
//! Why its own registry: the numbers must exist with `--policy off` too (no scheduler, no
//! `VolumeHandle`), and an operator's `/metrics` scrape must read them without stopping I/O.
//! So every counter is a relaxed atomic in a [`VolumeStats`] that a session looks up once
//! (like `scheduler_handle`) and then updates with a few `fetch_add`s per request; the scrape
//! (`api::metrics`) reads the atomics where they are, nothing is copied per request.
//!
//! Per request: one clock read when its header has been read (`arrive`) and one when its
//! reply is handed to the writer (`complete`), a latency bucket and a latency sum, payload
//! bytes for READ and WRITE, an error count on failure, and the audit's outstanding count
//! and arriving bytes. Once per second per active volume the first event of a new second
//! closes the audit's window under the volume's own mutex (never a global one).
//!
//! Bounds: one entry per volume (removed when the volume is deleted), fixed-size counters.

pub mod audit;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, Weak};

use headroom_nbd as nbd;
use headroom_qos::VolumeQos;
use headroom_store::{LatencyHistogram, LatencySnapshot};
use rustc_hash::FxHashMap;

use crate::clock::Clock;
use crate::scheduler::{Scheduler, VolumeCredits};
use crate::sync::{read, write};

pub use audit::AuditView;

/// `[metrics]`: how many volumes get series of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetricsConfig {
    /// A volume gets per-volume series only if it did I/O in the last this many seconds.
    pub volume_series_idle_s: u64,
    /// At most this many volumes get per-volume series (the most active); the others are
    /// summed into `volume="_other"`.
    pub max_volume_series: usize,
}

/// Default of [`MetricsConfig::volume_series_idle_s`].
pub const DEFAULT_VOLUME_SERIES_IDLE_S: u64 = 300;
/// Default of [`MetricsConfig::max_volume_series`].
pub const DEFAULT_MAX_VOLUME_SERIES: usize = 1000;
/// Largest `max_volume_series` a configuration may set.
pub const MAX_MAX_VOLUME_SERIES: usize = 100_000;
/// Longest `volume_series_idle_s`: a year; anything longer is "never idle" anyway, and it
/// keeps the arithmetic small.
pub const MAX_VOLUME_SERIES_IDLE_S: u64 = 366 * 24 * 3600;

impl MetricsConfig {
    /// Both values within their ranges (the keys are the configuration file's).
    pub fn validate(&self) -> Result<(), crate::setting::InvalidSetting> {
        use crate::setting::{InvalidSetting, count};
        if self.volume_series_idle_s > MAX_VOLUME_SERIES_IDLE_S {
            return Err(InvalidSetting::new(
                "metrics.volume_series_idle_s",
                self.volume_series_idle_s,
                format!("must be between 0 and {MAX_VOLUME_SERIES_IDLE_S}"),
            ));
        }
        if self.max_volume_series > MAX_MAX_VOLUME_SERIES {
            return Err(InvalidSetting::new(
                "metrics.max_volume_series",
                count(self.max_volume_series),
                format!("must be between 0 and {MAX_MAX_VOLUME_SERIES}"),
            ));
        }
        Ok(())
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            volume_series_idle_s: DEFAULT_VOLUME_SERIES_IDLE_S,
            max_volume_series: DEFAULT_MAX_VOLUME_SERIES,
        }
    }
}

/// An NBD operation as counted (the `op` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeOp {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
    BlockStatus,
}

impl VolumeOp {
    pub const ALL: [VolumeOp; 7] = [
        VolumeOp::Read,
        VolumeOp::Write,
        VolumeOp::Flush,
        VolumeOp::Trim,
        VolumeOp::WriteZeroes,
        VolumeOp::Cache,
        VolumeOp::BlockStatus,
    ];

    /// The `op` label value.
    pub fn name(self) -> &'static str {
        match self {
            VolumeOp::Read => "read",
            VolumeOp::Write => "write",
            VolumeOp::Flush => "flush",
            VolumeOp::Trim => "trim",
            VolumeOp::WriteZeroes => "write_zeroes",
            VolumeOp::Cache => "cache",
            VolumeOp::BlockStatus => "block_status",
        }
    }

    /// The counted operation of an NBD command (`None`: DISC, which has no reply).
    #[inline]
    pub fn of(command: nbd::Command) -> Option<VolumeOp> {
        Some(match command {
            nbd::Command::Read => VolumeOp::Read,
            nbd::Command::Write => VolumeOp::Write,
            nbd::Command::Flush => VolumeOp::Flush,
            nbd::Command::Trim => VolumeOp::Trim,
            nbd::Command::WriteZeroes => VolumeOp::WriteZeroes,
            nbd::Command::Cache => VolumeOp::Cache,
            nbd::Command::BlockStatus => VolumeOp::BlockStatus,
            nbd::Command::Disc => return None,
        })
    }

    /// The `op` label of a raw NBD command type (requests rejected before validation).
    pub fn of_type(command_type: u16) -> Option<VolumeOp> {
        nbd::Command::from_u16(command_type).and_then(VolumeOp::of)
    }
}

/// Counters of one operation of one volume; operations = the histogram's count.
#[derive(Debug, Default)]
struct OpCounters {
    bytes: AtomicU64,
    errors: AtomicU64,
    latency: LatencyHistogram,
}

/// One operation's counters, read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Arrival (request header read) to reply handed to the writer.
    pub latency: LatencySnapshot,
}

impl OpStats {
    pub fn add(&mut self, other: &OpStats) {
        self.ops = self.ops.saturating_add(other.ops);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.errors = self.errors.saturating_add(other.errors);
        self.latency.add(&other.latency);
    }
}

/// What the node measures of one volume.
#[derive(Debug)]
pub struct VolumeStats {
    /// The store's volume id.
    pub key: u64,
    /// The volume's name (the `volume` label).
    pub name: Arc<str>,
    ops: [OpCounters; 7],
    audit: audit::Audit,
    /// Operations counted at the previous scrape (to rank volumes by recent activity).
    scraped_ops: AtomicU64,
}

impl VolumeStats {
    /// The QoS the audit judges the volume by (what `/metrics` shows without a scheduler).
    pub(crate) fn audited_qos(&self) -> VolumeQos {
        self.audit.qos()
    }

    /// Records `ops`, the volume's operations so far, at a scrape; returns how many were
    /// done since the previous scrape (to rank volumes by recent activity).
    pub(crate) fn ops_since_scrape(&self, ops: u64) -> u64 {
        ops.saturating_sub(self.scraped_ops.swap(ops, Ordering::Relaxed))
    }

    fn new(key: u64, name: &str, qos: &VolumeQos, now_ns: u64) -> VolumeStats {
        VolumeStats {
            key,
            name: Arc::from(name),
            ops: Default::default(),
            audit: audit::Audit::new(qos, now_ns),
            scraped_ops: AtomicU64::new(0),
        }
    }

    /// A request's header was read at `now_ns`; it carries `payload_bytes` (READ, WRITE).
    #[inline]
    pub fn arrive(&self, registry: &MetricsRegistry, now_ns: u64, payload_bytes: u64) {
        self.audit.close_due(self, registry, now_ns);
        self.audit.arrive(now_ns, payload_bytes);
    }

    /// The reply to a request that arrived at `arrival_ns` was handed to the writer at
    /// `now_ns`.
    #[inline]
    pub fn complete(
        &self,
        registry: &MetricsRegistry,
        op: VolumeOp,
        payload_bytes: u64,
        failed: bool,
        arrival_ns: u64,
        now_ns: u64,
    ) {
        self.audit.close_due(self, registry, now_ns);
        let c = &self.ops[op as usize];
        c.latency.record(now_ns.saturating_sub(arrival_ns));
        if payload_bytes > 0 {
            c.bytes.fetch_add(payload_bytes, Ordering::Relaxed);
        }
        if failed {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.audit.depart(now_ns);
    }

    /// Every operation's counters, in [`VolumeOp::ALL`] order.
    pub fn ops(&self) -> [OpStats; 7] {
        let mut out = [OpStats::default(); 7];
        for (o, c) in out.iter_mut().zip(self.ops.iter()) {
            o.latency = c.latency.snapshot();
            o.ops = o.latency.count();
            o.bytes = c.bytes.load(Ordering::Relaxed);
            o.errors = c.errors.load(Ordering::Relaxed);
        }
        out
    }

    /// Requests completed and payload bytes moved, all operations (the audit's "served").
    fn served(&self) -> (u64, u64) {
        self.ops.iter().fold((0, 0), |(ops, bytes), c| {
            let s = c.latency.snapshot();
            (ops + s.count(), bytes + c.bytes.load(Ordering::Relaxed))
        })
    }

    /// The promise audit so far, closing every window that has ended by `now_ns`.
    pub fn audit(&self, registry: &MetricsRegistry, now_ns: u64) -> AuditView {
        self.audit.close_due(self, registry, now_ns);
        self.audit.view()
    }

    /// Second (node clock) of the volume's last request event.
    pub fn last_active_s(&self) -> u64 {
        self.audit.last_active_s()
    }

    /// The QoS the audit judges the volume by.
    pub fn set_qos(&self, qos: &VolumeQos) {
        self.audit.set_qos(qos);
    }
}

/// Every volume's [`VolumeStats`], by store id.
#[derive(Debug)]
pub struct MetricsRegistry {
    config: MetricsConfig,
    clock: Clock,
    volumes: RwLock<FxHashMap<u64, Arc<VolumeStats>>>,
    /// The scheduler, if a policy runs (the audit asks it about credits and held requests).
    scheduler: OnceLock<Weak<dyn VolumeCredits>>,
}

impl MetricsRegistry {
    pub fn new(config: MetricsConfig, clock: Clock) -> Arc<MetricsRegistry> {
        Arc::new(MetricsRegistry {
            config,
            clock,
            volumes: RwLock::new(FxHashMap::default()),
            scheduler: OnceLock::new(),
        })
    }

    pub fn config(&self) -> MetricsConfig {
        self.config
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Lets the audit ask the scheduler (set once at start).
    pub fn attach_scheduler<J: Send + 'static>(&self, scheduler: &Arc<Scheduler<J>>)
    where
        Scheduler<J>: Send + Sync,
    {
        let credits: Arc<dyn VolumeCredits> = Arc::clone(scheduler) as Arc<dyn VolumeCredits>;
        let _ = self.scheduler.set(Arc::downgrade(&credits));
    }

    pub(crate) fn scheduler(&self) -> Option<Arc<dyn VolumeCredits>> {
        self.scheduler.get().and_then(Weak::upgrade)
    }

    /// The stats of volume `key`, registered with `qos` if new.
    pub fn volume(&self, key: u64, name: &str, qos: &VolumeQos) -> Arc<VolumeStats> {
        if let Some(stats) = self.get(key) {
            return stats;
        }
        let mut volumes = write(&self.volumes);
        Arc::clone(
            volumes
                .entry(key)
                .or_insert_with(|| Arc::new(VolumeStats::new(key, name, qos, self.clock.now_ns()))),
        )
    }

    pub fn get(&self, key: u64) -> Option<Arc<VolumeStats>> {
        read(&self.volumes).get(&key).cloned()
    }

    /// Forgets a deleted volume.
    pub fn remove(&self, key: u64) {
        write(&self.volumes).remove(&key);
    }

    /// Every registered volume's stats.
    pub fn all(&self) -> Vec<Arc<VolumeStats>> {
        read(&self.volumes).values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_qos::IoRate;

    const S: u64 = 1_000_000_000;

    fn volume(baseline_iops: u64) -> (Arc<MetricsRegistry>, Arc<VolumeStats>) {
        let registry = MetricsRegistry::new(MetricsConfig::default(), Clock::new());
        let qos = VolumeQos {
            baseline: IoRate::new(baseline_iops, u64::MAX),
            ..VolumeQos::default()
        };
        let stats = Arc::new(VolumeStats::new(1, "v", &qos, 10 * S));
        (registry, stats)
    }

    /// A closed loop of `depth` requests served at `iops` for the whole second `second`.
    fn closed_loop(r: &MetricsRegistry, v: &VolumeStats, second: u64, depth: u64, iops: u64) {
        let start = second * S;
        for _ in 0..depth {
            v.arrive(r, start, 4096);
        }
        for i in 0..iops {
            let t = start + (i + 1) * (S - 1) / (iops + 1);
            v.complete(r, VolumeOp::Read, 4096, false, start, t);
            v.arrive(r, t, 4096);
        }
    }

    #[test]
    fn a_closed_loop_served_below_its_baseline_is_short_by_the_difference() {
        let (r, v) = volume(1000);
        closed_loop(&r, &v, 11, 32, 600);
        closed_loop(&r, &v, 12, 0, 990);
        let audit = v.audit(&r, 13 * S + 1);
        assert_eq!(audit.short_seconds, 1, "{audit:?}");
        assert_eq!(audit.shortfall_ops, 400);
        assert_eq!(audit.shortfall_bytes, 400 * 4096);
        assert_eq!(audit.own_limit_seconds, 0);
        // Reading again closes nothing new.
        assert_eq!(v.audit(&r, 13 * S + 2), audit);
        // Counts are exact whatever the audit does.
        assert_eq!(v.ops()[0].ops, 1590);
        assert_eq!(v.ops()[0].bytes, 1590 * 4096);
    }

    #[test]
    fn a_stalled_node_makes_every_silent_second_short_and_an_idle_volume_none() {
        let (r, v) = volume(1000);
        // Second 11: one request arrives and is never answered.
        v.arrive(&r, 11 * S + S / 2, 4096);
        // Read at 15.5: second 11 was mostly idle (not short); 12, 13 and 14 were stalled.
        let audit = v.audit(&r, 15 * S + S / 2);
        assert_eq!(audit.short_seconds, 3, "{audit:?}");
        assert_eq!(audit.shortfall_ops, 3000);
        // Answered at 15.6; nothing more for a while: idle seconds are not short.
        v.complete(&r, VolumeOp::Read, 4096, true, 11 * S, 15 * S + S * 6 / 10);
        let later = v.audit(&r, 30 * S);
        assert_eq!(later.short_seconds, 3, "{later:?}");
        assert_eq!(v.ops()[0].errors, 1);
        assert_eq!(v.last_active_s(), 11);
    }
}
