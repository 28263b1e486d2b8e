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
//! nobody to fence. Nothing a client writes into the pool chooses the address: the omap
//! value `owner` that earlier releases kept on the lease object (and fenced) is no longer
//! read, and is removed at the next takeover.
//!
//! **Losing the lease.** A renewal that finds the lock gone or held by another, or no
//! successful renewal for a whole lease duration (a watchdog thread checks this, since the
//! renewer may be stuck waiting for an unresponsive cluster), means another node may be
//! serving. The node then stops at once: the store's pool handle refuses every later data
//! and metadata operation (`Pool::stop_io`), so no NBD request reaches the cluster any more,
//! and the loss is recorded (`Lease::loss`) for the node to report (`GET /readyz` answers
//! 503 naming it) before it exits with `LEASE_LOST_EXIT_STATUS` (node crate; docs/
//! operations.md). (Its writes would fail anyway once it is blocklisted.)

use std::ffi::{CStr, CString};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cls_lock_info::{LockHolder, decode_holders};
use crate::error::StoreError;
use crate::lease_loss::LeaseLoss;
use crate::rados::{OmapBatch, Pool};

const LEASE_OBJECT: &CStr = c"lease";
const LOCK_NAME: &CStr = c"headroom";
/// cls_lock keeps lock `headroom`'s state in this xattr of the locked object.
const LOCK_XATTR: &CStr = c"lock.headroom";
/// Where releases before decision 44 kept the holder's own address (no longer read).
const OLD_OWNER_KEY: &[u8] = b"owner";

/// The loss of a lease, once it happened; shared by the renewer, the watchdog and the store.
type SharedLoss = Arc<Mutex<Option<LeaseLoss>>>;

/// A held lease; renewed by a thread until dropped (which releases it) or lost.
pub(crate) struct Lease {
    pool: Arc<Pool>,
    cookie: CString,
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// The renewer and the watchdog (taken by `release`).
    threads: Mutex<Vec<JoinHandle<()>>>,
    loss: SharedLoss,
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
        let mut attempt = Instant::now();
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
            attempt = Instant::now();
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
        let sent = Instant::now();
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
            std::thread::Builder::new()
                .name("rados-lease".into())
                .spawn(move || renew_loop(&pool, &cookie, duration, &stop, &renewed, &loss))?
        };
        // Apart from the renewer, which may be stuck in a call to a cluster that does not
        // answer (librados retries an operation for as long as it takes).
        let watchdog = {
            let (pool, stop, loss) = (Arc::clone(&pool), Arc::clone(&stop), Arc::clone(&loss));
            std::thread::Builder::new()
                .name("rados-lease-watch".into())
                .spawn(move || watch_loop(&pool, duration, &stop, &renewed, &loss))?
        };
        Ok(Lease {
            pool,
            cookie,
            stop,
            threads: Mutex::new(vec![renewer, watchdog]),
            loss,
        })
    }

    /// Why and when the lease was lost; `None` while it is held.
    pub(crate) fn loss(&self) -> Option<LeaseLoss> {
        self.loss.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
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

fn renew_loop(
    pool: &Pool,
    cookie: &CStr,
    duration: Duration,
    stop: &(Mutex<bool>, Condvar),
    renewed: &Mutex<Instant>,
    loss: &SharedLoss,
) {
    let last = || *renewed.lock().unwrap_or_else(|e| e.into_inner());
    // A third of a lease after the last renewal that succeeded (at once if that is past), so
    // a slow renewal does not push the next one later.
    // Never closer than a sixteenth of a lease apart (a failing cluster is not hammered).
    let next = || {
        (duration / 3)
            .saturating_sub(last().elapsed())
            .max(duration / 16)
    };
    let is_lost = || loss.lock().unwrap_or_else(|e| e.into_inner()).is_some();
    while !stopped(stop, next()) && !is_lost() {
        let sent = Instant::now();
        match pool.lock_exclusive(LEASE_OBJECT, LOCK_NAME, cookie, duration, true) {
            // (Not after the watchdog gave up: the node stopped serving then.)
            Ok(true) if !is_lost() => *renewed.lock().unwrap_or_else(|e| e.into_inner()) = sent,
            Ok(true) => return,
            Ok(false) => return lose(pool, loss, "another node holds it now"),
            Err(e) if last().elapsed() >= duration => return lose(pool, loss, &e.to_string()),
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
    renewed: &Mutex<Instant>,
    loss: &SharedLoss,
) {
    while !stopped(stop, duration / 8) {
        if loss.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
        let last = *renewed.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= duration {
            return lose(
                pool,
                loss,
                "no renewal succeeded for a whole lease duration (the cluster does not answer)",
            );
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
    /// Stops renewing and releases the lease (a clean stop: the unlock removes this node
    /// from the lock, so the next node fences nobody); every later I/O of the store is
    /// refused. Once only: later calls, and the drop, do nothing. Called at the end of a
    /// clean shutdown rather than left to the drop, which may come only when the last
    /// reference to the store goes, or not at all before the process exits.
    pub(crate) fn release(&self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        if threads.is_empty() {
            return;
        }
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
        if let Err(e) = self.pool.unlock(LEASE_OBJECT, LOCK_NAME, &self.cookie) {
            tracing::warn!(error = %e, "releasing the store's lease failed; it expires by itself");
        }
        self.pool
            .stop_io("it released the store's lease (clean shutdown)");
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
