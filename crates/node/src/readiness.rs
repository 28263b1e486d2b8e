//! The answer of `GET /readyz`, within a bound: why the node should get no new work.
//!
//! Why a module: on a RADOS store the check may have to commit to the cluster (a probe commit
//! after a failed one), and a cluster that does not answer would hold the probe for as long
//! as librados waits (30 s by default), longer than any load balancer's probe timeout. So the
//! probe commit runs on a blocking thread and the answer waits for it at most
//! `READY_PROBE_BOUND_MS`; past that, and while that probe is still out, the answer is 503
//! "metadata store not answering" without starting another one (probes every second must
//! not pile up blocking threads). A lost lease (lease.rs) is answered at once, without I/O.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_store::Store;

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
        {
            let mut since = self
                .in_flight_since
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(started) = *since {
                return vec![format!(
                    "the metadata store is not answering: a probe commit has waited {} ms",
                    started.elapsed().as_millis()
                )];
            }
            *since = Some(Instant::now());
        }
        let (store, flag) = (Arc::clone(store), Arc::clone(&self.in_flight_since));
        let probe = tokio::task::spawn_blocking(move || {
            let health = store.commit_health();
            *flag.lock().unwrap_or_else(|p| p.into_inner()) = None;
            health
        });
        match tokio::time::timeout(Duration::from_millis(READY_PROBE_BOUND_MS), probe).await {
            Ok(Ok(health)) => health.reasons,
            Ok(Err(err)) => {
                *self
                    .in_flight_since
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = None;
                vec![format!("the readiness check failed: {err}")]
            }
            Err(_) => vec![format!(
                "the metadata store is not answering: no answer to a probe commit within \
                 {READY_PROBE_BOUND_MS} ms"
            )],
        }
    }
}
