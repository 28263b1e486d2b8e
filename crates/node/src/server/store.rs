//! Opening the store of the configured backend (files, memory or RADOS), off the runtime's
//! threads when opening may block, with the node's overcommit and admission settings.

use std::sync::Arc;

use headroom_store::{RadosTarget, Store, StoreConfig, StoreError};

use super::NodeError;
use crate::config::{NodeConfig, StoreBackend};

/// Opens the store `config` names.
pub(super) async fn open_store(config: &NodeConfig) -> Result<Arc<Store>, NodeError> {
    let store = match &config.backend {
        StoreBackend::Files {
            data_dir,
            device_count,
            device_capacity_bytes,
            device_paths,
        } => {
            let mut store_config = StoreConfig::new(data_dir.clone());
            store_config.device_count = *device_count;
            store_config.device_capacity_bytes = *device_capacity_bytes;
            store_config.device_paths = device_paths.clone();
            store_config.metadata_reserve_bytes = config.metadata_reserve_bytes;
            store_config.checksums = config.checksums;
            // Opening may punch free space after a crash: keep it off the runtime threads.
            tokio::task::spawn_blocking(move || Store::open(&store_config))
                .await
                .map_err(|err| StoreError::Io(std::io::Error::other(err)))??
        }
        StoreBackend::Memory { capacity_bytes } => Store::open_memory(*capacity_bytes)?,
        StoreBackend::Rados {
            data_dir,
            conf,
            id,
            pool,
            capacity_bytes,
            namespace,
            lease_ms,
            lease_wait_ms,
            lease_lost_linger_ms: _,
        } => {
            let mut store_config = StoreConfig::new(data_dir.clone());
            store_config.device_capacity_bytes = *capacity_bytes;
            let mut target = RadosTarget::new(conf.clone(), pool.clone());
            target.id = id.clone();
            target.namespace = namespace.clone();
            target.lease_ms = *lease_ms;
            target.lease_wait_ms = *lease_wait_ms;
            store_config.rados = Some(target);
            // Taking the lease may wait for another node's to expire.
            // Connecting and the startup punch are network round trips.
            tokio::task::spawn_blocking(move || Store::open(&store_config))
                .await
                .map_err(|err| StoreError::Io(std::io::Error::other(err)))??
        }
    };
    store.set_overcommit_ratio(config.overcommit_ratio);
    store.set_admission_policy(config.device_admission.clone());
    Ok(Arc::new(store))
}
