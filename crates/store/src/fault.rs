//! Fault injection: a seeded layer between the volumes and the devices that makes chosen
//! requests fail (EIO, ENOSPC), stall (latency spikes) or find their device gone.
//!
//! Why: the server's error paths (errno mapping, sticky sync failures, a pool device that
//! dies, isolation of the other tenants) only run when something breaks, and real devices
//! break rarely and never on cue. This is a testing tool, off unless configured
//! (`Store::inject_faults`; the serve configuration's `[faults]` section).
//!
//! A rule has one scope:
//! - **a volume** (`FaultScope::Volume`): decided once per request of that volume, before it
//!   touches a device, so the rest of the pool is untouched. A failed read or write has
//!   changed nothing; a sync fault fails that volume's FLUSH (or the durability step of its
//!   FUA write, after the data was written) without marking any device failed.
//! - **a device** (`FaultScope::Device`): decided on every operation of that pool device,
//!   whichever volume (or the store's own commit) issued it. A sync fault goes down the same
//!   path as a failed `fdatasync`: the device is failed for good, every later sync on it fails.
//!   A device that disappears fails every later operation with ENODEV.
//!
//! An optional byte range narrows a rule to the reads and writes that overlap it (logical
//! bytes of the volume, or physical bytes of the device); syncs have no range and always match.
//!
//! **Determinism.** Each rule counts the operations it sees; whether operation `n` fails or
//! stalls is a hash of (seed, rule index, n), so the same seed and the same order of
//! operations give the same faults, with no lock on the I/O path. Concurrent clients race for
//! the numbers, so only the order is nondeterministic, not the sequence.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Largest `latency_spike_ms` (a minute): longer is a hang, not a spike.
pub const MAX_LATENCY_SPIKE_MS: u64 = 60_000;

/// What a rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultScope {
    /// Every request of the volume with this name (it may be created later).
    Volume(String),
    /// Every operation on the pool device with this id (`GET /v1/pool` lists them).
    Device(u32),
}

impl fmt::Display for FaultScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultScope::Volume(name) => write!(f, "volume {name:?}"),
            FaultScope::Device(id) => write!(f, "device {id}"),
        }
    }
}

/// One fault rule: a scope and what happens there. Probabilities are per mille (0..=1000)
/// of the operations in scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    pub scope: FaultScope,
    /// First byte of the range the rule applies to (reads and writes); 0 with no range.
    pub offset_bytes: u64,
    /// Length of the range; `None`: to the end.
    pub length_bytes: Option<u64>,
    /// Reads that fail with EIO.
    pub eio_read_permille: u32,
    /// Writes (WRITE, WRITE_ZEROES) that fail with EIO.
    pub eio_write_permille: u32,
    /// Syncs (FLUSH, the durability step of FUA) that fail with EIO.
    pub eio_sync_permille: u32,
    /// Writes that fail with ENOSPC.
    pub enospc_write_permille: u32,
    /// Syncs that fail with ENOSPC (a filesystem that reports a full disk at writeback, as
    /// XFS, btrfs, NFS and thin LVM can): the FLUSH fails, the device stays in service.
    pub enospc_sync_permille: u32,
    /// Writes fail with ENOSPC once this many bytes were written in scope (a full device).
    pub enospc_after_bytes: Option<u64>,
    /// Operations that take `latency_spike_ms` longer (they block their thread, as a slow
    /// `pread` does).
    pub latency_spike_permille: u32,
    pub latency_spike_ms: u64,
    /// The scope disappears after this many operations: every later one fails (EIO on NBD).
    pub disappear_after_ops: Option<u64>,
    /// The scope disappears this long after the faults were installed.
    pub disappear_after_ms: Option<u64>,
}

impl FaultRule {
    /// A rule that does nothing yet.
    pub fn new(scope: FaultScope) -> FaultRule {
        FaultRule {
            scope,
            offset_bytes: 0,
            length_bytes: None,
            eio_read_permille: 0,
            eio_write_permille: 0,
            eio_sync_permille: 0,
            enospc_write_permille: 0,
            enospc_sync_permille: 0,
            enospc_after_bytes: None,
            latency_spike_permille: 0,
            latency_spike_ms: 0,
            disappear_after_ops: None,
            disappear_after_ms: None,
        }
    }

    /// Checks the values; the error names the key, the value and what is allowed.
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        for (key, value) in [
            ("eio_read_permille", self.eio_read_permille),
            ("eio_write_permille", self.eio_write_permille),
            ("eio_sync_permille", self.eio_sync_permille),
            ("enospc_write_permille", self.enospc_write_permille),
            ("enospc_sync_permille", self.enospc_sync_permille),
            ("latency_spike_permille", self.latency_spike_permille),
        ] {
            if value > 1000 {
                return Err(FaultConfigError::new(key, value, "must be at most 1000"));
            }
        }
        let write = self.eio_write_permille + self.enospc_write_permille;
        if write > 1000 {
            return Err(FaultConfigError::new(
                "eio_write_permille",
                self.eio_write_permille,
                "eio_write_permille + enospc_write_permille must be at most 1000",
            ));
        }
        if self.eio_sync_permille + self.enospc_sync_permille > 1000 {
            return Err(FaultConfigError::new(
                "eio_sync_permille",
                self.eio_sync_permille,
                "eio_sync_permille + enospc_sync_permille must be at most 1000",
            ));
        }
        if self.latency_spike_ms > MAX_LATENCY_SPIKE_MS {
            return Err(FaultConfigError::new(
                "latency_spike_ms",
                self.latency_spike_ms,
                "must be at most 60000 (one minute)",
            ));
        }
        if self.latency_spike_permille > 0 && self.latency_spike_ms == 0 {
            return Err(FaultConfigError::new(
                "latency_spike_ms",
                0,
                "must be greater than 0 when latency_spike_permille is set",
            ));
        }
        if self.length_bytes == Some(0) {
            return Err(FaultConfigError::new(
                "length_bytes",
                0,
                "must be greater than 0 (leave it out for the rest of the scope)",
            ));
        }
        if let FaultScope::Volume(name) = &self.scope
            && name.is_empty()
        {
            return Err(FaultConfigError::new(
                "volume",
                "\"\"",
                "must name a volume",
            ));
        }
        Ok(())
    }

    /// Whether the rule can ever do anything.
    pub fn is_inert(&self) -> bool {
        self.eio_read_permille == 0
            && self.eio_write_permille == 0
            && self.eio_sync_permille == 0
            && self.enospc_write_permille == 0
            && self.enospc_sync_permille == 0
            && self.enospc_after_bytes.is_none()
            && self.latency_spike_permille == 0
            && self.disappear_after_ops.is_none()
            && self.disappear_after_ms.is_none()
    }
}

/// What `Store::inject_faults` installs: a seed and the rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultConfig {
    pub seed: u64,
    pub rules: Vec<FaultRule>,
}

impl FaultConfig {
    /// Checks every rule; the error's key is prefixed with the rule's index (`rule[1].…`).
    pub fn validate(&self) -> Result<(), FaultConfigError> {
        for (i, rule) in self.rules.iter().enumerate() {
            rule.validate().map_err(|mut err| {
                err.key = format!("rule[{i}].{}", err.key);
                err
            })?;
        }
        Ok(())
    }
}

/// A fault configuration value out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{key} = {value}: {allowed}")]
pub struct FaultConfigError {
    /// The key (`rule[0].eio_read_permille`).
    pub key: String,
    /// The value given.
    pub value: String,
    /// What is allowed.
    pub allowed: &'static str,
}

impl FaultConfigError {
    fn new(key: &str, value: impl fmt::Display, allowed: &'static str) -> FaultConfigError {
        FaultConfigError {
            key: key.to_string(),
            value: value.to_string(),
            allowed,
        }
    }
}

/// The kind of an operation, as the rules see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoClass {
    Read,
    /// WRITE and WRITE_ZEROES (and zeroing on a device).
    Write,
    /// FLUSH, FUA's durability step, a device sync.
    Sync,
    /// TRIM, punches, CACHE, BLOCK_STATUS: only a disappeared scope fails them.
    Other,
}

impl IoClass {
    fn name(self) -> &'static str {
        match self {
            IoClass::Read => "read",
            IoClass::Write => "write",
            IoClass::Sync => "sync",
            IoClass::Other => "other",
        }
    }
}

/// The fault an operation gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    Eio,
    Enospc,
    /// The scope disappeared (now or earlier).
    Gone,
}

/// What a rule decided for one operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Decision {
    /// Stall this long before doing (or failing) the operation.
    pub spike: Option<Duration>,
    pub fault: Option<Fault>,
    /// This operation made the scope disappear (log it once).
    pub disappeared_now: bool,
}

/// A rule installed on a store: its counters and whether its scope is gone.
#[derive(Debug)]
pub(crate) struct ActiveRule {
    pub rule: FaultRule,
    pub index: usize,
    seed: u64,
    started: Instant,
    /// Operations seen in scope.
    ops: AtomicU64,
    /// Bytes written in scope (for `enospc_after_bytes`).
    written_bytes: AtomicU64,
    gone: AtomicBool,
}

/// SplitMix64's finaliser: a good 64-bit mix of a counter.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number in `0..1000` from 32 random bits (multiply-shift, no modulo).
fn permille_of(bits: u32) -> u32 {
    ((u64::from(bits) * 1000) >> 32) as u32
}

impl ActiveRule {
    pub(crate) fn new(rule: FaultRule, index: usize, seed: u64, started: Instant) -> ActiveRule {
        ActiveRule {
            rule,
            index,
            seed,
            started,
            ops: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            gone: AtomicBool::new(false),
        }
    }

    /// Whether `[offset, offset + len)` overlaps the rule's range (syncs always do).
    fn in_range(&self, class: IoClass, offset: u64, len: u64) -> bool {
        if class == IoClass::Sync {
            return true;
        }
        let start = self.rule.offset_bytes;
        let end = self
            .rule
            .length_bytes
            .map_or(u64::MAX, |l| start.saturating_add(l));
        let op_end = offset.saturating_add(len.max(1));
        offset < end && op_end > start
    }

    /// The random bits for operation `n`.
    fn bits(&self, n: u64) -> u64 {
        let salt = (self.index as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
        mix(self
            .seed
            .wrapping_add(salt)
            .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
    }

    /// Decides the fate of one operation in this rule's scope (`None` outside its range).
    pub(crate) fn decide(&self, class: IoClass, offset: u64, len: u64) -> Option<Decision> {
        if !self.in_range(class, offset, len) {
            return None;
        }
        let n = self.ops.fetch_add(1, Ordering::Relaxed);
        let r = &self.rule;
        let mut decision = Decision::default();
        let expired = r.disappear_after_ops.is_some_and(|k| n >= k)
            || r.disappear_after_ms
                .is_some_and(|ms| self.started.elapsed() >= Duration::from_millis(ms));
        if self.gone.load(Ordering::Relaxed) || expired {
            decision.disappeared_now = !self.gone.swap(true, Ordering::Relaxed);
            decision.fault = Some(Fault::Gone);
            return Some(decision);
        }
        let bits = self.bits(n);
        if r.latency_spike_permille > 0
            && permille_of((bits >> 32) as u32) < r.latency_spike_permille
        {
            decision.spike = Some(Duration::from_millis(r.latency_spike_ms));
        }
        let draw = permille_of(bits as u32);
        decision.fault = match class {
            IoClass::Read => (draw < r.eio_read_permille).then_some(Fault::Eio),
            IoClass::Write => {
                if draw < r.enospc_write_permille {
                    Some(Fault::Enospc)
                } else if draw < r.enospc_write_permille + r.eio_write_permille {
                    Some(Fault::Eio)
                } else if let Some(limit) = r.enospc_after_bytes {
                    let before = self.written_bytes.fetch_add(len, Ordering::Relaxed);
                    if before.saturating_add(len) > limit {
                        self.written_bytes.fetch_sub(len, Ordering::Relaxed);
                        Some(Fault::Enospc)
                    } else {
                        None
                    }
                } else {
                    None
                }
            }
            IoClass::Sync if draw < r.eio_sync_permille => Some(Fault::Eio),
            IoClass::Sync => {
                (draw < r.eio_sync_permille + r.enospc_sync_permille).then_some(Fault::Enospc)
            }
            IoClass::Other => None,
        };
        Some(decision)
    }

    /// Whether the scope has disappeared.
    #[cfg(test)]
    pub(crate) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    /// Whether the scope has disappeared, by count or by time, without counting an
    /// operation (a device checks this before it is used for a new extent or a sync, so a
    /// device gone by time is failed even when nothing touched it since). Logs the
    /// disappearance if this call noticed it.
    pub(crate) fn vanished(&self) -> bool {
        if self.gone.load(Ordering::Relaxed) {
            return true;
        }
        let expired = self
            .rule
            .disappear_after_ms
            .is_some_and(|ms| self.started.elapsed() >= Duration::from_millis(ms));
        if expired && !self.gone.swap(true, Ordering::Relaxed) {
            self.log_disappeared();
        }
        expired
    }

    fn log_disappeared(&self) {
        tracing::error!(
            rule = self.index,
            "fault injection: {} disappeared; every later operation on it fails",
            self.rule.scope
        );
    }
}

/// Runs the rules over one operation: stalls for every spike, returns the first fault with
/// the rule that caused it, and logs a disappearance once.
pub(crate) fn apply<'a>(
    rules: impl Iterator<Item = &'a ActiveRule>,
    class: IoClass,
    offset: u64,
    len: u64,
) -> Option<(Fault, &'a ActiveRule)> {
    let mut first = None;
    for rule in rules {
        let Some(decision) = rule.decide(class, offset, len) else {
            continue;
        };
        if decision.disappeared_now {
            rule.log_disappeared();
        }
        if let Some(spike) = decision.spike {
            std::thread::sleep(spike);
        }
        if first.is_none()
            && let Some(fault) = decision.fault
        {
            first = Some((fault, rule));
        }
    }
    first
}

/// The error an injected fault surfaces as: ENOSPC as `StorageFull` (what a full filesystem
/// gives), the others as errors whose text says they were injected.
pub(crate) fn io_error(fault: Fault, rule: &ActiveRule, class: IoClass) -> io::Error {
    let text = match fault {
        Fault::Eio => "EIO",
        Fault::Enospc => "ENOSPC",
        Fault::Gone => "ENODEV (gone)",
    };
    let kind = match fault {
        Fault::Enospc => io::ErrorKind::StorageFull,
        Fault::Eio | Fault::Gone => io::ErrorKind::Other,
    };
    io::Error::new(
        kind,
        format!(
            "injected fault (rule {}, {}): {text} on {}",
            rule.index,
            rule.rule.scope,
            class.name()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(f: impl FnOnce(&mut FaultRule)) -> FaultRule {
        let mut r = FaultRule::new(FaultScope::Volume("v".into()));
        f(&mut r);
        r
    }

    /// The faults of `count` operations of `class` as a string of `.` (none), `E` (EIO),
    /// `S` (ENOSPC), `G` (gone), with `!` after a spiking one.
    fn trace(active: &ActiveRule, class: IoClass, count: usize) -> String {
        let mut out = String::new();
        for i in 0..count {
            let d = active
                .decide(class, i as u64 * 4096, 4096)
                .expect("in range");
            out.push(match d.fault {
                None => '.',
                Some(Fault::Eio) => 'E',
                Some(Fault::Enospc) => 'S',
                Some(Fault::Gone) => 'G',
            });
            if d.spike.is_some() {
                out.push('!');
            }
        }
        out
    }

    #[test]
    fn the_same_seed_gives_the_same_fault_sequence() {
        let r = rule(|r| {
            r.eio_read_permille = 100;
            r.eio_write_permille = 50;
            r.enospc_write_permille = 50;
            r.eio_sync_permille = 300;
            r.latency_spike_permille = 20;
            r.latency_spike_ms = 1;
        });
        let run = |seed: u64| {
            let a = ActiveRule::new(r.clone(), 0, seed, Instant::now());
            let mut s = trace(&a, IoClass::Read, 500);
            s += &trace(&a, IoClass::Write, 500);
            s += &trace(&a, IoClass::Sync, 100);
            s
        };
        let first = run(42);
        assert_eq!(first, run(42), "same seed, same sequence");
        assert_ne!(first, run(43), "another seed, another sequence");
        // Every kind of fault occurs.
        for c in ['E', 'S', '!', '.'] {
            assert!(first.contains(c), "{c} missing in {first}");
        }
        // Another rule index under the same seed draws differently.
        let other = ActiveRule::new(r.clone(), 1, 42, Instant::now());
        assert_ne!(trace(&other, IoClass::Read, 500), first[..500]);
    }

    #[test]
    fn rates_match_the_permille() {
        let r = rule(|r| {
            r.eio_read_permille = 100;
            r.eio_write_permille = 30;
            r.enospc_write_permille = 70;
            r.latency_spike_permille = 10;
            r.latency_spike_ms = 1;
        });
        let a = ActiveRule::new(r, 0, 7, Instant::now());
        let n = 100_000;
        let reads = trace(&a, IoClass::Read, n);
        let eio = reads.matches('E').count();
        let spikes = reads.matches('!').count();
        // Binomial: 10,000 ± 95 (σ); 5σ bounds.
        assert!((9_525..=10_475).contains(&eio), "{eio}");
        assert!((842..=1_158).contains(&spikes), "{spikes}");
        let writes = trace(&a, IoClass::Write, n);
        let enospc = writes.matches('S').count();
        let eio = writes.matches('E').count();
        assert!((6_600..=7_400).contains(&enospc), "{enospc}");
        assert!((2_730..=3_270).contains(&eio), "{eio}");
        // Other operations never fail unless the scope is gone.
        assert!(!trace(&a, IoClass::Other, 1000).contains(['E', 'S']));
    }

    #[test]
    fn zero_and_full_rates() {
        let never = ActiveRule::new(rule(|_| {}), 0, 1, Instant::now());
        assert_eq!(trace(&never, IoClass::Read, 1000), ".".repeat(1000));
        let always = ActiveRule::new(
            rule(|r| {
                r.eio_read_permille = 1000;
                r.eio_sync_permille = 1000;
                r.enospc_write_permille = 1000;
            }),
            0,
            1,
            Instant::now(),
        );
        assert_eq!(trace(&always, IoClass::Read, 100), "E".repeat(100));
        assert_eq!(trace(&always, IoClass::Write, 100), "S".repeat(100));
        assert_eq!(trace(&always, IoClass::Sync, 100), "E".repeat(100));
    }

    #[test]
    fn disappearing_after_ops_fails_everything_later_and_reports_it_once() {
        let a = ActiveRule::new(
            rule(|r| r.disappear_after_ops = Some(5)),
            0,
            1,
            Instant::now(),
        );
        assert_eq!(trace(&a, IoClass::Read, 5), ".....");
        let d = a.decide(IoClass::Other, 0, 0).expect("in range");
        assert_eq!(d.fault, Some(Fault::Gone));
        assert!(d.disappeared_now);
        for class in [IoClass::Read, IoClass::Write, IoClass::Sync, IoClass::Other] {
            let d = a.decide(class, 0, 4096).expect("in range");
            assert_eq!(d.fault, Some(Fault::Gone));
            assert!(!d.disappeared_now);
        }
        assert!(a.is_gone());
    }

    #[test]
    fn disappearing_after_ms_counts_from_installation() {
        let long_ago = Instant::now() - Duration::from_millis(50);
        let a = ActiveRule::new(rule(|r| r.disappear_after_ms = Some(40)), 0, 1, long_ago);
        assert_eq!(trace(&a, IoClass::Read, 1), "G");
        let b = ActiveRule::new(
            rule(|r| r.disappear_after_ms = Some(60_000)),
            0,
            1,
            Instant::now(),
        );
        assert_eq!(trace(&b, IoClass::Read, 3), "...");
        assert!(!b.vanished());
        // Noticed without an operation.
        let c = ActiveRule::new(rule(|r| r.disappear_after_ms = Some(40)), 0, 1, long_ago);
        assert!(c.vanished() && c.is_gone());
        assert_eq!(trace(&c, IoClass::Read, 1), "G");
    }

    #[test]
    fn enospc_after_bytes_is_a_full_device() {
        let a = ActiveRule::new(
            rule(|r| r.enospc_after_bytes = Some(10 * 4096)),
            0,
            1,
            Instant::now(),
        );
        assert_eq!(trace(&a, IoClass::Write, 12), "..........SS");
        // Reads still work on a full device.
        assert_eq!(trace(&a, IoClass::Read, 3), "...");
    }

    #[test]
    fn a_range_limits_reads_and_writes_but_not_syncs() {
        let a = ActiveRule::new(
            rule(|r| {
                r.offset_bytes = 8192;
                r.length_bytes = Some(4096);
                r.eio_read_permille = 1000;
                r.eio_sync_permille = 1000;
            }),
            0,
            1,
            Instant::now(),
        );
        assert!(a.decide(IoClass::Read, 0, 8192).is_none());
        assert!(a.decide(IoClass::Read, 12288, 4096).is_none());
        assert_eq!(
            a.decide(IoClass::Read, 4096, 8192).map(|d| d.fault),
            Some(Some(Fault::Eio))
        );
        assert_eq!(
            a.decide(IoClass::Sync, 0, 0).map(|d| d.fault),
            Some(Some(Fault::Eio))
        );
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |f: fn(&mut FaultRule)| {
            let mut r = FaultRule::new(FaultScope::Device(0));
            f(&mut r);
            let config = FaultConfig {
                seed: 0,
                rules: vec![FaultRule::new(FaultScope::Device(1)), r],
            };
            config.validate().expect_err("invalid").to_string()
        };
        assert_eq!(
            bad(|r| r.eio_read_permille = 1001),
            "rule[1].eio_read_permille = 1001: must be at most 1000"
        );
        assert!(
            bad(|r| {
                r.eio_write_permille = 600;
                r.enospc_write_permille = 600;
            })
            .contains("eio_write_permille + enospc_write_permille")
        );
        assert!(bad(|r| r.latency_spike_permille = 5).contains("rule[1].latency_spike_ms = 0"));
        assert!(bad(|r| r.latency_spike_ms = 60_001).contains("one minute"));
        assert!(bad(|r| r.length_bytes = Some(0)).contains("length_bytes = 0"));
        assert!(bad(|r| r.scope = FaultScope::Volume(String::new())).contains("rule[1].volume"));
        assert!(FaultRule::new(FaultScope::Device(0)).is_inert());
    }
}
