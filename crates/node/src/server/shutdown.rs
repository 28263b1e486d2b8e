//! Stopping a node: NBD alone (the API keeps answering), or everything, in an order that
//! makes every acknowledged write durable and saves the exact credit balances before the
//! store's lease is released.

use std::sync::Arc;

use headroom_store::StoreError;

use super::credits::save_credits;
use super::{NodeError, RunningNode};

/// How long a stop waits for the I/O tasks off the runtime (a FLUSH's fsync at most).
const OFF_THREAD_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl RunningNode {
    /// Stops serving NBD and nothing else: the listener closes (new connections are
    /// refused) and every open connection is closed; the management API keeps answering
    /// (`/readyz` says why the node is not ready).
    pub fn stop_nbd(&self) {
        let _ = self.nbd_stop.send(true);
        let closed = self.connections.close_all();
        tracing::info!(
            closed,
            "stopped serving NBD: listener and connections closed"
        );
    }

    /// Stops accepting, then makes every acknowledged write durable and saves the exact
    /// credit balances.
    pub async fn shutdown(self) -> Result<(), NodeError> {
        // Receivers may already be gone if a task ended; that is fine.
        let _ = self.stop.send(true);
        let _ = self.nbd_stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        // Their frontends disconnected, their queues' last replies delivered and sockets
        // removed; they stay stored for the next start. First, while the connection threads
        // their queues run on are still there, and letting go of those threads.
        self.attachments.stop_all().await;
        // The accept loops and the attachments are gone, so the connection threads drop
        // their connections and end: wait for that, so nothing of a session still holds the
        // store below.
        if let Some(ended) = self.threads_ended
            && !tokio::task::spawn_blocking(move || ended.wait(OFF_THREAD_WAIT))
                .await
                .unwrap_or(false)
        {
            tracing::warn!("stopping with NBD connection threads still running");
        }
        if let Some(saver) = self.saver {
            saver.stop();
        }
        if let Some(arbitration) = self.arbitration {
            // Releases the arbiter lock: another node takes the role at its next epoch.
            tokio::task::spawn_blocking(move || arbitration.stop())
                .await
                .map_err(|err| NodeError::Flush(StoreError::Io(std::io::Error::other(err))))?;
        }
        let store = Arc::clone(&self.store);
        let scheduler = self.scheduler.clone();
        let io = Arc::clone(&self.pipeline.io);
        tokio::task::spawn_blocking(move || {
            // What the lanes and the blocking pool still run lets go of its volume first.
            if !io.work.wait_idle(OFF_THREAD_WAIT) {
                tracing::warn!("stopping with I/O tasks still running off the runtime");
            }
            store.flush_all().map_err(NodeError::Flush)?;
            if let Some(scheduler) = &scheduler {
                save_credits(&store, scheduler, true, 0)?;
                // Tracked in debug builds (`QosConfig::server_params`): say if it broke.
                if let Err(violation) = scheduler.check_invariants() {
                    tracing::error!("the scheduler broke an invariant: {violation}");
                }
                scheduler.stop();
            }
            // Last: nothing writes to the store after this (a RADOS store's lease).
            store.release_lease();
            Ok(())
        })
        .await
        .map_err(|err| NodeError::Flush(StoreError::Io(std::io::Error::other(err))))?
    }
}
