//! The exclusive lease a node holds on a RADOS store while it serves it, and the fencing of
//! the previous holder (several nodes, one pool).
//!
//! Why: every node that can reach the pool could open the store, but two nodes writing the
//! same extents and metadata would corrupt both; so a node serves a RADOS store only while it
//! holds the lease, and a node that takes the lease over first makes sure the previous holder
//! can no longer write anything.
//!
//! **The lease** is a RADOS exclusive lock (`cls_lock`, `rados_lock_exclusive`) named
//! `headroom` on the object `lease` of the store's namespace, taken with a random cookie for
//! a duration (`StoreConfig::rados`, `lease`), renewed once more after fencing and from then on a
//! third of a lease after the last renewal that succeeded. A node that
//! finds it held polls until it expires (or gives up after the configured wait).
//!
//! **Fencing.** The node fences the holder whose lock it replaced, at the address the OSD
//! recorded for that holder's connection when it took the lock (docs/ARCHITECTURE.md,
//! decision 44): while the lock is held by another, each poll asks the OSD who holds it
//! (`rados_list_lockers`) and remembers the answer; a node that finds the lock already
//! expired at its first attempt never sees the holder that way (cls_lock leaves expired
//! holders out of every read), so before that attempt it reads the lock's raw state, the
//! xattr `lock.headroom`, which keeps the expired holder until the next lock call rewrites it
//! (decoded by cls_lock_info.rs; bytes it cannot decode make the takeover fail rather than
//! go ahead unfenced). Having acquired the lock, the node blocklists that address on the
//! OSDs (`rados_blocklist_add`, one hour) and waits for the newest OSD map *before* it reads
//! the metadata or serves anything: from then on every operation of the old holder's RADOS
//! client, data and metadata alike, fails with `EBLOCKLISTED`, so a holder that was only
//! paused (SIGSTOP, a long GC-like stall, a network partition) cannot land a late write. A
//! clean shutdown unlocks, which removes the holder from the lock, so the next node has
//! nobody to fence; so it unlocks only once nothing of this node can land any more: every
//! new operation refused first, then the ones under way waited for (rados_inflight.rs;
//! [`Lease::release`]). Nothing a client writes into the pool chooses the address: the omap
//! value `owner` that earlier releases kept on the lease object (and fenced) is no longer
//! read, and is removed at the next takeover.
//!
//! **Losing the lease.** A renewal that finds the lock gone or held by another, or no
//! successful renewal for a whole lease duration (a watchdog thread checks this, since the
//! renewer may be stuck waiting for an unresponsive cluster), means another node may be
//! serving. The lease's age is read on `CLOCK_BOOTTIME`, which runs on while the machine is
//! suspended, as the OSDs' clocks do, and the pool refuses every operation once the lease
//! may have run out on it, before the watchdog looks (lease_clock.rs). The node then stops at once: the store's pool handle refuses every later data
//! and metadata operation (`Pool::stop_io`), so no NBD request reaches the cluster any more,
//! and the loss is recorded (`Lease::loss`) for the node to report (`GET /readyz` answers
//! 503 naming it) before it exits with `LEASE_LOST_EXIT_STATUS` (node crate; docs/
//! operations.md). (Its writes would fail anyway once it is blocklisted.)

use std::ffi::{CStr, CString};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cls_lock_assert::encode_assert_exclusive;
use crate::cls_lock_info::{LockHolder, decode_holders};
use crate::error::StoreError;
use crate::lease_clock::{LeaseClock, LeaseExpiry, boot_clock};
use crate::lease_loss::LeaseLoss;
use crate::rados::{OmapBatch, Pool};
use crate::rados_meta::META_OBJECT;

const LEASE_OBJECT: &CStr = c"lease";
const LOCK_NAME: &CStr = c"headroom";
/// cls_lock keeps lock `headroom`'s state in this xattr of the locked object.
const LOCK_XATTR: &CStr = c"lock.headroom";
/// Where releases before decision 44 kept the holder's own address (no longer read).
const OLD_OWNER_KEY: &[u8] = b"owner";

/// The loss of a lease, once it happened; shared by the renewer, the watchdog and the store.
type SharedLoss = Arc<Mutex<Option<LeaseLoss>>>;

/// How long a release waits for the operations under way to end before it unlocks (a
/// fraction of the lease, which is renewed meanwhile); past it the lease is left to expire.
fn drain_timeout(duration: Duration) -> Duration {
    duration / 2
}

/// A held lease; renewed by a thread until dropped (which releases it) or lost.
pub(crate) struct Lease {
    pool: Arc<Pool>,
    cookie: CString,
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// The renewer and the watchdog (taken by `release`).
    threads: Mutex<Vec<JoinHandle<()>>>,
    loss: SharedLoss,
    duration: Duration,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("cookie", &self.cookie)
            .finish()
    }
}

fn io_err(e: std::io::Error) -> StoreError {
    StoreError::Io(e)
}

impl Lease {
    /// Takes the store's lease, waiting up to `wait` (`None`: as long as it takes) while
    /// another node holds it; then fences the previous holder and starts renewing.
    pub(crate) fn acquire(
        pool: Arc<Pool>,
        duration: Duration,
        wait: Option<Duration>,
    ) -> Result<Lease, StoreError> {
        Lease::acquire_with_clock(pool, duration, wait, boot_clock())
    }

    /// [`Lease::acquire`] with the lease's age read on `clock`.
    pub(crate) fn acquire_with_clock(
        pool: Arc<Pool>,
        duration: Duration,
        wait: Option<Duration>,
        clock: LeaseClock,
    ) -> Result<Lease, StoreError> {
        let addr = pool.client_addr().map_err(io_err)?;
        let cookie = CString::new(format!(
            "{}-{}",
            std::process::id(),
            crate::rados::new_namespace().map_err(io_err)?
        ))
        .map_err(|_| StoreError::InvalidConfig("lease cookie".into()))?;
        let started = Instant::now();
        let poll = (duration / 8).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut logged = false;
        // Who held the lock before the first attempt, expired holders included (the raw
        // state); replaced by what the OSD answers while the lock is held by another. A
        // holder takes a whole lease to expire, much longer than a poll, so the last answer
        // names the holder whose expired lock the successful attempt replaces.
        let mut previous = recorded_holders(&pool);
        let mut attempt = clock();
        while !pool
            .lock_exclusive(LEASE_OBJECT, LOCK_NAME, &cookie, duration, false)
            .map_err(io_err)?
        {
            let holders = pool.lockers(LEASE_OBJECT, LOCK_NAME).map_err(io_err)?;
            if !holders.is_empty() {
                previous = Ok(holders);
            }
            if !logged {
                tracing::info!(
                    store = pool.label.as_str(),
                    holder = ?previous.as_ref().ok(),
                    "the store's lease is held by another node; waiting for it to expire"
                );
                logged = true;
            }
            if let Some(wait) = wait
                && started.elapsed() >= wait
            {
                return Err(StoreError::InvalidConfig(format!(
                    "the lease of {} is held by another node (still after {} ms); stop that \
                     node, or wait for its lease to expire",
                    pool.label,
                    wait.as_millis()
                )));
            }
            std::thread::sleep(poll);
            attempt = clock();
        }
        // The lease runs from the moment the successful request was sent, at the latest.
        let renewed = Arc::new(Mutex::new(attempt));
        let previous = previous.map_err(|e| {
            // Unlock again: the next node should not find a lock nobody serves.
            let _ = pool.unlock(LEASE_OBJECT, LOCK_NAME, &cookie);
            StoreError::InvalidConfig(format!(
                "cannot tell which node held the lease of {} before (the lock's state, xattr \
                 lock.headroom of object lease, does not decode: {e}); refusing to take the \
                 store over without fencing that node",
                pool.label
            ))
        })?;
        for prev in previous
            .iter()
            .filter(|h| h.addr != addr && h.cookie.as_bytes() != cookie.as_bytes())
        {
            pool.blocklist(&prev.addr).map_err(io_err)?;
            tracing::warn!(
                store = pool.label.as_str(),
                previous = prev.addr.as_str(),
                previous_client = prev.client.as_str(),
                previous_cookie = prev.cookie.as_str(),
                "took over the lease of a node that did not release it: fenced it (blocklisted)"
            );
        }
        // The address earlier releases kept in the omap: gone, so nobody takes it for
        // something this node reads.
        let batch = OmapBatch {
            rm: vec![OLD_OWNER_KEY.to_vec()],
            ..OmapBatch::default()
        };
        pool.omap_commit(LEASE_OBJECT, &batch).map_err(io_err)?;
        // Fencing waits for the newest OSD map, which can take most of a lease on a loaded
        // cluster: renew before serving, so the node starts with a whole lease ahead of it
        // (and learns now, not mid-request, if the lease ran out while it fenced).
        let sent = clock();
        if !pool
            .lock_exclusive(LEASE_OBJECT, LOCK_NAME, &cookie, duration, true)
            .map_err(io_err)?
        {
            return Err(StoreError::InvalidConfig(format!(
                "the lease of {} expired while this node fenced the previous holder, and \
                 another node holds it now",
                pool.label
            )));
        }
        *renewed.lock().unwrap_or_else(|e| e.into_inner()) = sent;
        pool.watch_lease_expiry(LeaseExpiry::new(Arc::clone(&clock), sent, duration));
        lock_metadata_object(&pool, &cookie, duration).inspect_err(|_| {
            let _ = pool.unlock(LEASE_OBJECT, LOCK_NAME, &cookie);
        })?;
        tracing::info!(
            store = pool.label.as_str(),
            client = addr.as_str(),
            lease_ms = duration.as_millis() as u64,
            waited_ms = started.elapsed().as_millis() as u64,
            "holding the store's lease"
        );
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let loss: SharedLoss = Arc::new(Mutex::new(None));
        let renewer = {
            let (pool, cookie, stop) = (Arc::clone(&pool), cookie.clone(), Arc::clone(&stop));
            let (renewed, loss) = (Arc::clone(&renewed), Arc::clone(&loss));
            let clock = Arc::clone(&clock);
            std::thread::Builder::new()
                .name("rados-lease".into())
                .spawn(move || {
                    renew_loop(&pool, &cookie, duration, &stop, &renewed, &loss, &clock)
                })?
        };
        // Apart from the renewer, which may be stuck in a call to a cluster that does not
        // answer (librados retries an operation for as long as it takes).
        let watchdog = {
            let (pool, stop, loss) = (Arc::clone(&pool), Arc::clone(&stop), Arc::clone(&loss));
            std::thread::Builder::new()
                .name("rados-lease-watch".into())
                .spawn(move || watch_loop(&pool, duration, &stop, &renewed, &loss, &clock))?
        };
        Ok(Lease {
            pool,
            cookie,
            stop,
            threads: Mutex::new(vec![renewer, watchdog]),
            loss,
            duration,
        })
    }

    /// Why and when the lease was lost; `None` while it is held.
    pub(crate) fn loss(&self) -> Option<LeaseLoss> {
        self.loss.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Takes this node's lock on the metadata object too (with the lease's cookie and duration,
/// renewed with it), and makes every metadata commit assert it (cls_lock_assert.rs). Called
/// holding the lease, after fencing: any other holder of the metadata object's lock is a
/// node that held the lease before (a clean release unlocks the metadata object first), so
/// fenced or gone, and its lock is broken rather than waited out.
fn lock_metadata_object(pool: &Pool, cookie: &CStr, duration: Duration) -> Result<(), StoreError> {
    for _ in 0..3 {
        if pool
            .lock_exclusive(META_OBJECT, LOCK_NAME, cookie, duration, false)
            .map_err(io_err)?
        {
            let assert_op = encode_assert_exclusive(LOCK_NAME.to_bytes(), cookie.to_bytes());
            pool.guard_commits(META_OBJECT, assert_op);
            // An empty commit, now, so that a user who may not run the assertion (it needs
            // `class-read` with `rw`) is refused at start, not at its first real commit.
            return match pool.omap_commit(META_OBJECT, &OmapBatch::default()) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                    Err(StoreError::InvalidConfig(format!(
                        "{e}: a metadata commit on {} carries cls_lock's assert_locked, which \
                         the RADOS user's osd caps must allow in the same grant as the writes: \
                         `allow rw class-read pool=POOL namespace=headroom-*` \
                         (docs/operations.md, \"The cephx user\")",
                        pool.label
                    )))
                }
                Err(e) => Err(io_err(e)),
            };
        }
        for holder in pool.lockers(META_OBJECT, LOCK_NAME).map_err(io_err)? {
            pool.break_lock(META_OBJECT, LOCK_NAME, &holder.client, &holder.cookie)
                .map_err(io_err)?;
            tracing::warn!(
                store = pool.label.as_str(),
                previous_client = holder.client.as_str(),
                previous_cookie = holder.cookie.as_str(),
                "broke the previous holder's lock on the metadata object"
            );
        }
    }
    Err(StoreError::InvalidConfig(format!(
        "the metadata object of {} stays locked by another node although this node holds \
         the lease; refusing to serve",
        pool.label
    )))
}

/// The holders the lock's raw state records (expired ones too); `Err` when it exists but
/// does not decode (the takeover then refuses, unless the lock turns out held and
/// `rados_list_lockers` names the holder).
fn recorded_holders(pool: &Pool) -> Result<Vec<LockHolder>, String> {
    match pool.xattr(LEASE_OBJECT, LOCK_XATTR) {
        Ok(None) => Ok(Vec::new()),
        Ok(Some(bytes)) => decode_holders(&bytes).map_err(|e| e.to_string()),
        Err(e) => Err(format!("reading it failed: {e}")),
    }
}

/// Waits up to `period` for the stop flag; true once it is set.
fn stopped(stop: &(Mutex<bool>, Condvar), period: Duration) -> bool {
    let (lock, cv) = stop;
    let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    let (guard, _) = cv
        .wait_timeout_while(guard, period, |stopped| !*stopped)
        .unwrap_or_else(|e| e.into_inner());
    *guard
}

/// Why a lease whose last renewal is a whole lease duration old is given up.
const NO_RENEWAL_FOR_A_LEASE: &str = "no renewal succeeded for a whole lease duration (the \
     cluster does not answer, or this machine was suspended)";

fn renew_loop(
    pool: &Pool,
    cookie: &CStr,
    duration: Duration,
    stop: &(Mutex<bool>, Condvar),
    renewed: &Mutex<Duration>,
    loss: &SharedLoss,
    clock: &LeaseClock,
) {
    let last = || *renewed.lock().unwrap_or_else(|e| e.into_inner());
    let age = || clock().saturating_sub(last());
    // A third of a lease after the last renewal that succeeded (at once if that is past), so
    // a slow renewal does not push the next one later.
    // Never closer than a sixteenth of a lease apart (a failing cluster is not hammered).
    let next = || (duration / 3).saturating_sub(age()).max(duration / 16);
    let is_lost = || loss.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    while !stopped(stop, next()) && !is_lost() {
        // A lease as old as a whole duration may be another node's by now (a suspend stops
        // this thread with the clock running on): given up here as by the watchdog, whichever
        // looks first, rather than renewed.
        if age() >= duration {
            return lose(pool, loss, NO_RENEWAL_FOR_A_LEASE);
        }
        let sent = clock();
        match pool.lock_exclusive(LEASE_OBJECT, LOCK_NAME, cookie, duration, true) {
            // (Not after the watchdog gave up: the node stopped serving then.)
            Ok(true) if !is_lost() => {
                // The metadata object's lock with it (its commits assert it): lost with it.
                match pool.lock_exclusive(META_OBJECT, LOCK_NAME, cookie, duration, true) {
                    Ok(true) => {}
                    Ok(false) => {
                        return lose(pool, loss, "another node holds the metadata object now");
                    }
                    Err(e) if age() >= duration => return lose(pool, loss, &e.to_string()),
                    Err(e) => {
                        tracing::warn!(error = %e, "renewing the metadata object's lock failed; retrying");
                        continue;
                    }
                }
                *renewed.lock().unwrap_or_else(|e| e.into_inner()) = sent;
                pool.lease_renewed(sent, duration);
            }
            Ok(true) => return,
            Ok(false) => return lose(pool, loss, "another node holds it now"),
            Err(e) if age() >= duration => return lose(pool, loss, &e.to_string()),
            Err(e) => tracing::warn!(error = %e, "renewing the store's lease failed; retrying"),
        }
    }
}

/// Gives the lease up once no renewal has succeeded for a whole lease duration, even while
/// the renewer waits for the cluster.
fn watch_loop(
    pool: &Pool,
    duration: Duration,
    stop: &(Mutex<bool>, Condvar),
    renewed: &Mutex<Duration>,
    loss: &SharedLoss,
    clock: &LeaseClock,
) {
    while !stopped(stop, duration / 8) {
        if loss.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
        let last = *renewed.lock().unwrap_or_else(|e| e.into_inner());
        if clock().saturating_sub(last) >= duration {
            return lose(pool, loss, NO_RENEWAL_FOR_A_LEASE);
        }
    }
}

/// The lease is lost: stops every later operation on the store's pool, records why (the
/// first reason wins) and says so.
fn lose(pool: &Pool, loss: &SharedLoss, why: &str) {
    pool.stop_io(&format!("it lost the store's lease ({why})"));
    let mut slot = loss.lock().unwrap_or_else(|e| e.into_inner());
    if slot.is_some() {
        return;
    }
    *slot = Some(LeaseLoss {
        why: why.to_owned(),
        at: std::time::SystemTime::now(),
    });
    tracing::error!(
        store = pool.label.as_str(),
        why,
        "lost the store's lease: another node may serve it now; this node stops serving"
    );
}

impl Lease {
    /// Releases the lease at a clean stop, in the order that keeps a successor safe: every
    /// new operation of the store is refused first, then the operations still under way
    /// (a request's write, an asynchronous write's completion, a commit) are waited for,
    /// renewing meanwhile; only then does renewing stop and the unlock remove this node from
    /// the lock, so the next node that takes it at once (fencing nobody) finds nothing of
    /// this node's still landing. If they do not end within half a lease, the lock is left to
    /// expire: the next node then fences this one. Once only: later calls, and the drop, do
    /// nothing. Called at the end of a clean shutdown rather than left to the drop, which may
    /// come only when the last reference to the store goes, or not at all before the process
    /// exits.
    pub(crate) fn release(&self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        if threads.is_empty() {
            return;
        }
        self.pool
            .stop_io("it released the store's lease (clean shutdown)");
        let drained = self.pool.wait_drained(drain_timeout(self.duration));
        {
            let (lock, cv) = &*self.stop;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_all();
        }
        for t in threads {
            let _ = t.join();
        }
        if self.loss().is_some() {
            return; // not ours any more
        }
        if !drained {
            tracing::warn!(
                store = self.pool.label.as_str(),
                in_flight = self.pool.ops_in_flight(),
                "operations of the store were still under way at release; leaving the lease \
                 to expire (the next node fences this one)"
            );
            return;
        }
        // The metadata object first: a node that takes the lease then finds it free.
        for object in [META_OBJECT, LEASE_OBJECT] {
            if let Err(e) = self.pool.unlock(object, LOCK_NAME, &self.cookie) {
                tracing::warn!(error = %e, "releasing the store's lease failed; it expires by itself");
                return;
            }
        }
        tracing::info!(
            store = self.pool.label.as_str(),
            "released the store's lease"
        );
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    //! Against the cluster of `HEADROOM_TEST_CEPH_CONF` (as `scripts/test` sets), each test in
    //! a namespace of its own; skipped without one (a failure under HEADROOM_REQUIRE_TOOLS).
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    fn test_pool() -> Option<Arc<Pool>> {
        let Some(conf) = std::env::var_os("HEADROOM_TEST_CEPH_CONF") else {
            assert!(
                std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_none(),
                "a test cluster is required (HEADROOM_REQUIRE_TOOLS is set) but \
                 HEADROOM_TEST_CEPH_CONF is not"
            );
            eprintln!("SKIPPED: no HEADROOM_TEST_CEPH_CONF");
            return None;
        };
        let pool = std::env::var("HEADROOM_TEST_CEPH_POOL").unwrap_or_else(|_| "headroom".into());
        let id = std::env::var("HEADROOM_TEST_CEPH_ID").unwrap_or_else(|_| "admin".into());
        let ns = crate::rados::new_namespace().unwrap();
        Some(Arc::new(
            Pool::connect(std::path::Path::new(&conf), &id, &pool, &ns).unwrap(),
        ))
    }

    /// Polls `done` until it holds; a failure after a guard far longer than it takes.
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let guard = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(Instant::now() < guard, "never: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn holds(pool: &Pool, lease: &Lease) -> bool {
        pool.lockers(LEASE_OBJECT, LOCK_NAME)
            .unwrap()
            .iter()
            .any(|h| h.cookie.as_bytes() == lease.cookie.to_bytes())
    }

    #[test]
    fn a_release_unlocks_only_after_the_operations_under_way_have_ended() {
        let Some(pool) = test_pool() else { return };
        let wait = Some(Duration::from_secs(30));
        let lease =
            Arc::new(Lease::acquire(Arc::clone(&pool), Duration::from_secs(30), wait).unwrap());
        assert!(holds(&pool, &lease));
        // An operation under way: a write whose completion has not come back yet.
        let op = pool.begin_op().unwrap();
        let releasing = {
            let lease = Arc::clone(&lease);
            std::thread::spawn(move || lease.release())
        };
        // The release refuses new operations at once ...
        wait_until("the release stops new operations", || {
            pool.begin_op().is_err()
        });
        // ... but keeps the lock while one could still land after a successor took over.
        assert!(
            holds(&pool, &lease),
            "unlocked while an operation of this node was under way"
        );
        drop(op);
        releasing.join().unwrap();
        assert!(
            !holds(&pool, &lease),
            "not unlocked once the operation ended"
        );
        assert!(lease.loss().is_none());
    }

    #[test]
    fn a_metadata_commit_is_refused_by_the_osd_once_another_node_holds_the_lock() {
        let Some(pool) = test_pool() else { return };
        let wait = Some(Duration::from_secs(30));
        let lease = Lease::acquire(Arc::clone(&pool), Duration::from_secs(30), wait).unwrap();
        let batch = |value: &[u8]| crate::rados::OmapBatch {
            set: vec![(b"k".to_vec(), value.to_vec())],
            ..crate::rados::OmapBatch::default()
        };
        pool.omap_commit(META_OBJECT, &batch(b"1")).unwrap();
        // Another node takes the metadata object's lock over without this one being fenced
        // (its blocklist entry ended, or fencing failed): the OSD, not this node, says no.
        let conf = std::env::var_os("HEADROOM_TEST_CEPH_CONF").unwrap();
        let name = std::env::var("HEADROOM_TEST_CEPH_POOL").unwrap_or_else(|_| "headroom".into());
        let id = std::env::var("HEADROOM_TEST_CEPH_ID").unwrap_or_else(|_| "admin".into());
        let ns = pool.label.rsplit('/').next().unwrap().to_owned();
        let other = Pool::connect(std::path::Path::new(&conf), &id, &name, &ns).unwrap();
        let holders = other.lockers(META_OBJECT, LOCK_NAME).unwrap();
        assert_eq!(holders.len(), 1, "{holders:?}");
        assert_eq!(holders[0].cookie.as_bytes(), lease.cookie.to_bytes());
        other
            .break_lock(
                META_OBJECT,
                LOCK_NAME,
                &holders[0].client,
                &holders[0].cookie,
            )
            .unwrap();
        let duration = Duration::from_secs(30);
        assert!(
            other
                .lock_exclusive(META_OBJECT, LOCK_NAME, c"other", duration, false)
                .unwrap()
        );
        let refused = pool
            .omap_commit(META_OBJECT, &batch(b"2"))
            .expect_err("a commit landed on a lock another node holds");
        assert!(
            refused.to_string().contains("no longer current"),
            "{refused}"
        );
        // What the successor reads is what it may rely on: the refused commit left nothing.
        let entries = other.omap_load(META_OBJECT, c"k").unwrap().unwrap();
        assert_eq!(entries, vec![(b"k".to_vec(), b"1".to_vec())]);
        other.unlock(META_OBJECT, LOCK_NAME, c"other").unwrap();
    }

    #[test]
    fn a_lease_a_whole_duration_old_on_the_boot_clock_is_given_up() {
        let Some(pool) = test_pool() else { return };
        let suspended_ns = Arc::new(AtomicU64::new(0));
        let clock: LeaseClock = {
            let (boot, suspended_ns) = (boot_clock(), Arc::clone(&suspended_ns));
            Arc::new(move || boot() + Duration::from_nanos(suspended_ns.load(Ordering::SeqCst)))
        };
        let duration = Duration::from_secs(4);
        let wait = Some(Duration::from_secs(30));
        let lease = Lease::acquire_with_clock(Arc::clone(&pool), duration, wait, clock).unwrap();
        assert!(lease.loss().is_none() && pool.begin_op().is_ok());
        // The machine was suspended for longer than a lease: the OSDs' clocks ran on, and
        // `CLOCK_BOOTTIME` with them, while no thread of this node ran.
        let jump_ns = u64::try_from(duration.as_nanos()).unwrap() + 1;
        suspended_ns.store(jump_ns, Ordering::SeqCst);
        // Not one more operation, before the watchdog or the renewer has looked ...
        let refused = pool
            .begin_op()
            .expect_err("an operation was sent on a run-out lease");
        assert!(
            refused.to_string().contains("may have run out"),
            "{refused}"
        );
        // ... and the lease is given up, by whichever looks first.
        wait_until("the lease is given up", || lease.loss().is_some());
        assert!(pool.begin_op().is_err(), "the store still takes I/O");
        let why = lease.loss().unwrap().why;
        assert!(why.contains("suspended"), "{why}");
    }
}
