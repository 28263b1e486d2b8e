//! The answer of `GET /readyz`, within a bound: why the node should get no new work.
//!
//! Why a module: after a failed metadata commit the check commits again (a probe), and a
//! device that does not answer would hold it for as long as the kernel waits, longer than any
//! load balancer's probe timeout (on RADOS the probe is a no-op today, so no check waits for
//! the cluster; the bound holds should it commit there). So the probe commit runs on a
//! blocking thread and the answer waits for it at most
//! `READY_PROBE_BOUND_MS`; past that, and while that probe is still out, the answer is 503
//! "metadata store not answering" without starting another one (probes every second must
//! not pile up blocking threads). A lost lease (lease.rs) is answered at once, without I/O.
//!
//! A commit that *hangs* (the disk under the data directory stopped answering, and with it
//! every FLUSH) is answered at once too: the store knows when each commit in progress started
//! (`Store::commit_hung_for`, no I/O), and past `headroom_store::COMMIT_HUNG_AFTER_MS` the
//! answer is its known health, which names the hung commit, with no probe started (it would
//! only queue behind the hung commit). Once the commit returns, the next answer is ready again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_store::Store;

use crate::sync::lock;

/// How long `/readyz` waits for a probe commit before it answers 503.
pub const READY_PROBE_BOUND_MS: u64 = 2_000;

/// At most one probe commit in flight, and since when.
#[derive(Debug, Default)]
pub struct ReadinessProbe {
    in_flight_since: Arc<Mutex<Option<Instant>>>,
}

impl ReadinessProbe {
    /// Why the node is not ready, one sentence each; empty when it is.
    pub async fn reasons(&self, store: &Arc<Store>) -> Vec<String> {
        if store.lease_lost().is_some() {
            // No I/O: the store's pool refuses everything now.
            return store.commit_health().reasons;
        }
        if store.commit_hung_for().is_some() {
            // No I/O: a probe commit would wait behind the hung one.
            return store.commit_health_known().reasons;
        }
        let store = Arc::clone(store);
        self.bounded(move || store.commit_health().reasons).await
    }

    /// Runs `probe` on a blocking thread and waits for it at most `READY_PROBE_BOUND_MS`;
    /// while an earlier probe is still out, answers at once without starting another.
    async fn bounded<P>(&self, probe: P) -> Vec<String>
    where
        P: FnOnce() -> Vec<String> + Send + 'static,
    {
        {
            let mut since = lock(&self.in_flight_since);
            if let Some(started) = *since {
                return vec![format!(
                    "the metadata store is not answering: a probe commit has waited {} ms",
                    started.elapsed().as_millis()
                )];
            }
            *since = Some(Instant::now());
        }
        let flag = Arc::clone(&self.in_flight_since);
        let probe = tokio::task::spawn_blocking(move || {
            let reasons = probe();
            *lock(&flag) = None;
            reasons
        });
        match tokio::time::timeout(Duration::from_millis(READY_PROBE_BOUND_MS), probe).await {
            Ok(Ok(reasons)) => reasons,
            Ok(Err(err)) => {
                *lock(&self.in_flight_since) = None;
                vec![format!("the readiness check failed: {err}")]
            }
            Err(_) => vec![format!(
                "the metadata store is not answering: no answer to a probe commit within \
                 {READY_PROBE_BOUND_MS} ms"
            )],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    use super::*;

    /// A probe that does not return until the test says so (a disk or cluster that does not
    /// answer), counting how many were started.
    fn hanging_probe(
        started: &Arc<AtomicUsize>,
        release: mpsc::Receiver<()>,
    ) -> impl FnOnce() -> Vec<String> + Send + 'static {
        let started = Arc::clone(started);
        move || {
            started.fetch_add(1, Ordering::SeqCst);
            let _ = release.recv();
            vec!["probed".to_string()]
        }
    }

    /// A metadata commit hung for longer than the store's bound (registered as started
    /// that long ago, so nothing waits): `/readyz` answers at once naming it, on no blocking
    /// thread (the runtime's only one is kept busy meanwhile: an answer that needed one would
    /// wait for the probe bound), and is ready again once the commit returns.
    #[test]
    fn a_hung_commit_is_answered_at_once_without_a_probe_and_then_ready_again() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(
            Store::open(&headroom_store::StoreConfig {
                device_count: 1,
                device_capacity_bytes: 64 << 20,
                metadata_reserve_bytes: 0,
                ..headroom_store::StoreConfig::new(dir.path())
            })
            .unwrap(),
        );
        let probe = ReadinessProbe::default();
        runtime.block_on(async {
            assert!(probe.reasons(&store).await.is_empty());

            let (free, busy_until) = mpsc::channel::<()>();
            let busy = tokio::task::spawn_blocking(move || {
                let _ = busy_until.recv();
            });
            let hung_ms = headroom_store::COMMIT_HUNG_AFTER_MS + 1_500;
            let since = Instant::now()
                .checked_sub(Duration::from_millis(hung_ms))
                .expect("the clock is past the hang's start");
            let hung = store.commit_in_progress_since(since);
            let asked = Instant::now();
            let reasons = probe.reasons(&store).await;
            let answered = asked.elapsed();
            assert_eq!(reasons.len(), 1, "{reasons:?}");
            let waited_ms: u64 = reasons[0]
                .strip_prefix("a metadata commit has not finished for ")
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{reasons:?}"));
            assert!(waited_ms >= hung_ms, "{reasons:?}");
            // At once, and without a probe commit in flight.
            assert!(
                answered < Duration::from_millis(READY_PROBE_BOUND_MS / 2),
                "{answered:?}"
            );
            assert!(lock(&probe.in_flight_since).is_none());
            // The metrics' gauge reads the same known health.
            assert!(!store.commit_health_known().is_ready());

            drop(hung);
            free.send(()).unwrap();
            busy.await.unwrap();
            assert!(probe.reasons(&store).await.is_empty());
            assert!(store.commit_health_known().is_ready());
        });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_probe_that_never_answers_is_answered_within_the_bound_and_not_repeated() {
        let probe = ReadinessProbe::default();
        let started = Arc::new(AtomicUsize::new(0));
        let (release, hung) = mpsc::channel();

        let asked = Instant::now();
        let outer = Duration::from_millis(READY_PROBE_BOUND_MS * 5);
        let first = tokio::time::timeout(outer, probe.bounded(hanging_probe(&started, hung)))
            .await
            .expect("/readyz waited for a probe that does not answer");
        let waited = asked.elapsed();
        assert_eq!(first.len(), 1, "{first:?}");
        assert!(
            first[0].contains("not answering") && first[0].contains("within 2000 ms"),
            "{first:?}"
        );
        // It waited for the probe up to the bound, and no longer than a loaded machine's
        // scheduling adds to it.
        assert!(
            waited >= Duration::from_millis(READY_PROBE_BOUND_MS),
            "{waited:?}"
        );

        // Asked again while the first probe is still out: an answer at once, no second probe.
        let (_unused, never) = mpsc::channel::<()>();
        let again = probe.bounded(hanging_probe(&started, never)).await;
        assert!(again[0].contains("has waited"), "{again:?}");
        assert_eq!(started.load(Ordering::SeqCst), 1);

        // Once it answers, the next question probes again and gets the probe's answer.
        release.send(()).unwrap();
        // (The first probe's thread clears its flag just after it returns: until then the
        // answer is still "has waited", with no probe started.)
        let deadline = Instant::now() + Duration::from_secs(30);
        let answered = loop {
            let (done, ready) = mpsc::channel::<()>();
            drop(done);
            let reasons = probe.bounded(hanging_probe(&started, ready)).await;
            if !reasons.iter().any(|r| r.contains("has waited")) {
                break reasons;
            }
            assert!(
                Instant::now() < deadline,
                "the released probe never finished"
            );
            tokio::task::yield_now().await;
        };
        assert_eq!(answered, vec!["probed".to_string()]);
        assert_eq!(started.load(Ordering::SeqCst), 2);
    }
}
