//! Starting and stopping a node: open the store, bind the NBD and API listeners, accept
//! connections up to the limit, and on shutdown stop accepting and flush everything.

use std::net::SocketAddr;
use std::sync::Arc;

use headroom_store::{Store, StoreConfig, StoreError};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::buffers::BufferPool;
use crate::config::{NodeConfig, StoreBackend};
use crate::exec::Executor;
use crate::session::{SessionContext, serve_connection};

/// Failures while starting or stopping a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("opening the store: {0}")]
    Store(#[from] StoreError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("starting I/O workers: {0}")]
    Workers(std::io::Error),
    #[error("flushing at shutdown: {0}")]
    Flush(StoreError),
}

/// Entry point.
#[derive(Debug)]
pub struct Node;

/// A node that is serving; dropping it without `shutdown` leaves the tasks running until the
/// runtime ends.
#[derive(Debug)]
pub struct RunningNode {
    pub nbd_addr: SocketAddr,
    pub api_addr: SocketAddr,
    store: Arc<Store>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Opens the store and starts both listeners.
    pub async fn start(config: NodeConfig) -> Result<RunningNode, NodeError> {
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
                // Opening may punch free space after a crash: keep it off the runtime threads.
                tokio::task::spawn_blocking(move || Store::open(&store_config))
                    .await
                    .map_err(|err| StoreError::Io(std::io::Error::other(err)))??
            }
            StoreBackend::Memory { capacity_bytes } => Store::open_memory(*capacity_bytes)?,
        };
        let store = Arc::new(store);
        let executor = if config.io_threads == 0 {
            None
        } else {
            Some(Executor::start(config.io_threads).map_err(NodeError::Workers)?)
        };
        let nbd_listener = TcpListener::bind(config.nbd_listen)
            .await
            .map_err(|source| NodeError::Bind {
                addr: config.nbd_listen,
                source,
            })?;
        let api_listener = TcpListener::bind(config.api_listen)
            .await
            .map_err(|source| NodeError::Bind {
                addr: config.api_listen,
                source,
            })?;
        let nbd_addr = local_addr(&nbd_listener, config.nbd_listen)?;
        let api_addr = local_addr(&api_listener, config.api_listen)?;
        let (stop, stop_rx) = watch::channel(false);

        let ctx = Arc::new(SessionContext {
            store: Arc::clone(&store),
            limits: config.limits.clone(),
            executor,
            inline_max_bytes: config.effective_inline_max_bytes(),
            buffers: Arc::new(BufferPool::new(config.limits.max_request_bytes as usize)),
        });
        let accept_task = tokio::spawn(accept_loop(
            nbd_listener,
            ctx,
            config.limits.max_connections,
            stop_rx.clone(),
        ));
        let api_task = tokio::spawn(crate::api::serve(api_listener, Arc::clone(&store), stop_rx));
        tracing::info!("NBD on {nbd_addr}, API on http://{api_addr}");
        Ok(RunningNode {
            nbd_addr,
            api_addr,
            store,
            stop,
            tasks: vec![accept_task, api_task],
        })
    }
}

fn local_addr(listener: &TcpListener, requested: SocketAddr) -> Result<SocketAddr, NodeError> {
    listener.local_addr().map_err(|source| NodeError::Bind {
        addr: requested,
        source,
    })
}

impl RunningNode {
    /// The store behind the node.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Stops accepting, then makes every acknowledged write durable.
    pub async fn shutdown(self) -> Result<(), NodeError> {
        // Receivers may already be gone if a task ended; that is fine.
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || store.flush_all())
            .await
            .map_err(|err| NodeError::Flush(StoreError::Io(std::io::Error::other(err))))?
            .map_err(NodeError::Flush)
    }
}

async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<SessionContext>,
    max_connections: usize,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(max_connections));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(err) => {
                // EMFILE and friends: keep serving the connections we have.
                tracing::warn!("accept failed: {err}");
                tokio::task::yield_now().await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::warn!("refusing {peer}: {max_connections} connections already open");
            drop(stream);
            continue;
        };
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            if let Err(err) = serve_connection(stream, ctx).await {
                tracing::info!("session with {peer} ended: {err}");
            }
            drop(slot);
        });
    }
}
