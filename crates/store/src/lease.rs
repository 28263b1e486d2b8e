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
//! **Fencing.** The holder's client address (`rados_getaddrs`) is kept in the lock object's
//! omap under `owner`. A node that acquires the lease and finds another address there
//! blocklists it on the OSDs (`rados_blocklist_add`, one hour) and waits for the newest OSD
//! map *before* it reads the metadata or serves anything: from then on every operation of the
//! old holder's RADOS client, data and metadata alike, fails with `EBLOCKLISTED`, so a holder
//! that was only paused (SIGSTOP, a long GC-like stall, a network partition) cannot land a
//! late write. A clean shutdown removes `owner` before unlocking, so the next node has nobody
//! to fence.
//!
//! **Losing the lease.** A renewal that finds the lock gone or held by another, or no
//! successful renewal for a whole lease duration (a watchdog thread checks this, since the
//! renewer may be stuck waiting for an unresponsive cluster), means another node may be
//! serving: the process logs it and exits (status 3) at once, which closes every NBD
//! connection, rather than keep serving I/O errors. (Its writes would fail anyway once it
//! is blocklisted.)

use std::ffi::{CStr, CString};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::StoreError;
use crate::rados::{OmapBatch, Pool};

const LEASE_OBJECT: &CStr = c"lease";
const LOCK_NAME: &CStr = c"headroom";
const OWNER_KEY: &[u8] = b"owner";

/// Exit status of a process that lost its lease.
pub const LEASE_LOST_EXIT_STATUS: i32 = 3;

/// A held lease; renewed by a thread until dropped (which releases it).
pub(crate) struct Lease {
    pool: Arc<Pool>,
    cookie: CString,
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// The renewer and the watchdog.
    threads: Vec<JoinHandle<()>>,
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
        let mut attempt = Instant::now();
        while !pool
            .lock_exclusive(LEASE_OBJECT, LOCK_NAME, &cookie, duration, false)
            .map_err(io_err)?
        {
            if !logged {
                tracing::info!(
                    store = pool.label.as_str(),
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
        let previous = pool
            .omap_load(LEASE_OBJECT, c"owner")
            .map_err(io_err)?
            .unwrap_or_default()
            .into_iter()
            .find(|(k, _)| k == OWNER_KEY)
            .map(|(_, v)| String::from_utf8_lossy(&v).into_owned());
        if let Some(prev) = previous.filter(|p| *p != addr) {
            pool.blocklist(&prev).map_err(io_err)?;
            tracing::warn!(
                store = pool.label.as_str(),
                previous = prev.as_str(),
                "took over the lease of a node that did not release it: fenced it (blocklisted)"
            );
        }
        let batch = OmapBatch {
            set: vec![(OWNER_KEY.to_vec(), addr.clone().into_bytes())],
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
        let renewer = {
            let (pool, cookie, stop) = (Arc::clone(&pool), cookie.clone(), Arc::clone(&stop));
            let renewed = Arc::clone(&renewed);
            std::thread::Builder::new()
                .name("rados-lease".into())
                .spawn(move || renew_loop(&pool, &cookie, duration, &stop, &renewed))?
        };
        // Apart from the renewer, which may be stuck in a call to a cluster that does not
        // answer (librados retries an operation for as long as it takes).
        let watchdog = {
            let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("rados-lease-watch".into())
                .spawn(move || watch_loop(&pool, duration, &stop, &renewed))?
        };
        Ok(Lease {
            pool,
            cookie,
            stop,
            threads: vec![renewer, watchdog],
        })
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
    while !stopped(stop, next()) {
        let sent = Instant::now();
        match pool.lock_exclusive(LEASE_OBJECT, LOCK_NAME, cookie, duration, true) {
            Ok(true) => *renewed.lock().unwrap_or_else(|e| e.into_inner()) = sent,
            Ok(false) => lost(pool, "another node holds it now"),
            Err(e) if last().elapsed() >= duration => lost(pool, &e.to_string()),
            Err(e) => tracing::warn!(error = %e, "renewing the store's lease failed; retrying"),
        }
    }
}

/// Exits once no renewal has succeeded for a whole lease duration, even while the renewer
/// waits for the cluster.
fn watch_loop(
    pool: &Pool,
    duration: Duration,
    stop: &(Mutex<bool>, Condvar),
    renewed: &Mutex<Instant>,
) {
    while !stopped(stop, duration / 8) {
        let last = *renewed.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= duration {
            lost(
                pool,
                "no renewal succeeded for a whole lease duration (the cluster does not answer)",
            );
        }
    }
}

fn lost(pool: &Pool, why: &str) -> ! {
    tracing::error!(
        store = pool.label.as_str(),
        why,
        "lost the store's lease: another node may serve it now; this node stops serving"
    );
    std::process::exit(LEASE_LOST_EXIT_STATUS)
}

impl Drop for Lease {
    fn drop(&mut self) {
        {
            let (lock, cv) = &*self.stop;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cv.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // A clean release: nobody to fence after us.
        let batch = OmapBatch {
            rm: vec![OWNER_KEY.to_vec()],
            ..OmapBatch::default()
        };
        if let Err(e) = self
            .pool
            .omap_commit(LEASE_OBJECT, &batch)
            .and_then(|()| self.pool.unlock(LEASE_OBJECT, LOCK_NAME, &self.cookie))
        {
            tracing::warn!(error = %e, "releasing the store's lease failed; it expires by itself");
        }
    }
}
