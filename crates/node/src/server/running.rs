//! A node that is serving, as its owner sees it: the store, the scheduler, the API's token
//! and state, volumes created in process, and the loss of a RADOS lease.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use headroom_store::Store;

use super::{NodeError, RunningNode};
use crate::pipeline::IoJob;
use crate::scheduler::Scheduler;

impl RunningNode {
    /// The store behind the node.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Creates a volume with a QoS class (none: unlimited) and registers it with the
    /// scheduler, as `POST /v1/volumes` does. Blocking (a durable metadata commit).
    pub fn create_volume(
        &self,
        name: &str,
        size_bytes: u64,
        spec: Option<headroom_qos::QosSpec>,
    ) -> Result<headroom_store::VolumeInfo, NodeError> {
        create_volume(&self.store, self.scheduler.as_ref(), name, size_bytes, spec)
    }

    /// The management API's bearer token.
    pub fn api_token(&self) -> &crate::api::ApiToken {
        &self.api_token
    }

    /// The state the management API's handlers share (the one its listener serves), for
    /// callers that drive `crate::api::router` in process: the `router` fuzz target.
    pub fn api_state(&self) -> &crate::api::ApiState {
        &self.api_state
    }

    /// Attaches an in-memory client (`crate::memory_transport`) from `peer` to `export` as
    /// `tenant`: the pipeline's second transport, beside NBD, admitted and charged alike.
    pub fn attach_in_memory(
        &self,
        peer: SocketAddr,
        export: &str,
        tenant: Option<&str>,
    ) -> Result<crate::memory_transport::MemorySession, crate::memory_transport::AttachError> {
        crate::memory_transport::attach(
            &self.store,
            &self.connections,
            &self.pipeline,
            peer,
            export,
            tenant,
        )
    }

    /// Serves `volume` on a vhost-user-blk socket (`spec`), stored with the volume, as
    /// `POST /v1/volumes/{name}/attachments` does: listening when this returns.
    pub async fn attach_vhost_user(
        &self,
        volume: &str,
        spec: crate::vhost_user::AttachmentSpec,
    ) -> Result<(), crate::vhost_user::AttachmentError> {
        self.attachments.attach(volume, spec).await
    }

    /// `volume`'s vhost-user attachments and what their frontends are doing, as
    /// `GET /v1/volumes/{name}/attachments` shows them.
    pub fn vhost_user_attachments(
        &self,
        volume: &str,
    ) -> Vec<(
        crate::vhost_user::AttachmentSpec,
        crate::vhost_user::AttachmentState,
    )> {
        self.attachments
            .list(Some(volume))
            .into_iter()
            .map(|(_, spec, state)| (spec, state))
            .collect()
    }

    /// Ends a vhost-user attachment (`DELETE /v1/volumes/{name}/attachments`).
    pub async fn detach_vhost_user(
        &self,
        volume: &str,
        path: &std::path::Path,
    ) -> Result<(), crate::vhost_user::AttachmentError> {
        self.attachments.detach(volume, path).await
    }

    /// The QoS scheduler, if a policy is on.
    pub fn scheduler(&self) -> Option<&Arc<Scheduler<IoJob>>> {
        self.scheduler.as_ref()
    }

    /// Completes once the node has lost the lease of its RADOS store (never for another
    /// store): from then on the store refuses every I/O (lease.rs). Checked every 100 ms.
    pub async fn lease_lost(&self) -> headroom_store::LeaseLoss {
        loop {
            if let Some(loss) = self.store.lease_lost() {
                return loss;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// [`RunningNode::create_volume`] on a store and scheduler (the bench's node has no
/// `RunningNode`).
pub(super) fn create_volume(
    store: &Store,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    name: &str,
    size_bytes: u64,
    spec: Option<headroom_qos::QosSpec>,
) -> Result<headroom_store::VolumeInfo, NodeError> {
    let stored = match spec {
        Some(spec) if !spec.is_empty() => Some(
            crate::volume_qos::StoredQos::resolve(spec, size_bytes)
                .map_err(|err| NodeError::Qos(err.to_string()))?,
        ),
        _ => None,
    };
    let record = stored.as_ref().map(crate::volume_qos::StoredQos::to_json);
    let info = store.create_volume_with_qos(name, size_bytes, record)?;
    if let Some(scheduler) = scheduler {
        let qos = stored.map_or_else(headroom_qos::VolumeQos::default, |s| s.qos);
        scheduler.add_volume(info.id, &qos);
    }
    Ok(info)
}
