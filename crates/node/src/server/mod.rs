//! Starting and stopping a node: open the store, bind the NBD and API listeners, accept
//! connections up to the limit, and on shutdown stop accepting and flush everything.
//!
//! [`Node::start`] reads as the order in which a node is assembled; each step lives in the
//! file of its concept: opening the store (`store.rs`); credentials, the I/O runtime, the
//! scheduler, arbitration, the sessions' context and background work (`assembly.rs`);
//! credit balances across restarts and the volumes registered with the scheduler
//! (`credits.rs`); the limits and file descriptors, which also cap the API's connections
//! (`fd_limits.rs`); the NBD accept loops and their sessions (`accept.rs`), the NBD Unix
//! socket's file (`unix_socket.rs`) and the same rules for vhost-user sockets
//! (`vhost_socket.rs`); the running node's
//! handles (`running.rs`) and shutdown (`shutdown.rs`). The API listener is served by
//! `crate::api::serve`, started last here with the state its handlers share.

mod accept;
mod assembly;
/// Compiled only with the `bench-support` feature (see `Cargo.toml`).
#[cfg(feature = "bench-support")]
#[doc(hidden)]
pub mod bench_support;
mod credits;
mod fd_limits;
mod running;
mod shutdown;
mod store;
mod unix_socket;
mod vhost_socket;

use std::net::SocketAddr;
use std::sync::Arc;

use headroom_store::{Store, StoreError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::Connections;
use crate::clock::Clock;
use crate::config::NodeConfig;
use crate::pipeline::{IoJob, Pipeline};
use crate::scheduler::{Scheduler, SchedulerError};
use credits::CreditSaver;

pub use fd_limits::{FD_RESERVE, api_limits_within};
pub use unix_socket::UnixSocketError;

/// Failures while starting or stopping a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("opening the store: {0}")]
    Store(#[from] StoreError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the NBD Unix socket: {0}")]
    UnixSocket(#[from] UnixSocketError),
    #[error("starting I/O workers: {0}")]
    Workers(std::io::Error),
    #[error("flushing at shutdown: {0}")]
    Flush(StoreError),
    #[error("starting the scheduler: {0}")]
    Scheduler(#[from] SchedulerError),
    #[error("emulated device: {0}")]
    Emulated(String),
    #[error("invalid QoS: {0}")]
    Qos(String),
    #[error("API token: {0}")]
    Token(#[from] crate::api::TokenError),
    #[error("API tokens: {0}")]
    Tokens(#[from] crate::api::tokens::TokensError),
    #[error("{0}")]
    AuditLog(#[from] crate::api::audit_log::AuditLogError),
    #[error("arbitration: {0}")]
    Arbitration(String),
    #[error("saving credit balances: {0}")]
    Credits(StoreError),
    #[error(
        "TLS is configured, but this server was built without TLS; rebuild with --features tls"
    )]
    TlsUnavailable,
    #[cfg(feature = "tls")]
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

/// Entry point.
#[derive(Debug)]
pub struct Node;

/// A node that is serving; dropping it without `shutdown` leaves the tasks running until the
/// runtime ends.
#[derive(Debug)]
pub struct RunningNode {
    /// The NBD TCP listener's address; `None`: TCP is off (`nbd_listen = "off"`).
    pub nbd_addr: Option<SocketAddr>,
    /// The NBD Unix socket's path, if the node listens on one.
    pub nbd_unix: Option<std::path::PathBuf>,
    pub api_addr: SocketAddr,
    store: Arc<Store>,
    scheduler: Option<Arc<Scheduler<IoJob>>>,
    stop: watch::Sender<bool>,
    /// Stops the NBD accept loop alone (`stop_nbd`; `shutdown` stops everything).
    nbd_stop: watch::Sender<bool>,
    connections: Arc<Connections>,
    /// The request path every transport's clients use (`memory_transport` attaches to it).
    pipeline: Arc<Pipeline>,
    tasks: Vec<JoinHandle<()>>,
    /// When the NBD connection threads have ended (`crate::net_threads`), for `shutdown`.
    threads_ended: Option<crate::net_threads::ThreadsEnded>,
    saver: Option<CreditSaver>,
    arbitration: Option<crate::arbitration::Arbitration>,
    api_token: crate::api::ApiToken,
    /// What the API listener serves (`api_state`).
    api_state: crate::api::ApiState,
    /// The vhost-user-blk attachments (`crate::vhost_user`).
    attachments: Arc<crate::vhost_user::Attachments>,
}

impl Node {
    /// Opens the store and starts both listeners.
    pub async fn start(config: NodeConfig) -> Result<RunningNode, NodeError> {
        Node::start_with_clock(config, Clock::new()).await
    }

    /// [`Node::start`] on `clock`: a manual one (`Clock::manual`) lets a test decide when the
    /// node's time moves.
    pub async fn start_with_clock(
        config: NodeConfig,
        clock: Clock,
    ) -> Result<RunningNode, NodeError> {
        config.validate()?;
        // Credentials first: a typo in a key file must not leave a half-started node.
        let credentials = assembly::Credentials::load(&config)?;
        let store = store::open_store(&config).await?;
        let io = assembly::start_io(&config, &store, clock)?;
        let metrics = crate::metrics::MetricsRegistry::new(config.metrics, io.clock);
        let scheduler = assembly::start_scheduler(&config, &store, &io, &metrics)?;
        // Before any I/O: replace the exact balances of a clean shutdown by running ones, so
        // a crash from here on never finds more credit than was spent (volume_qos docs).
        let saver = match &scheduler {
            Some(scheduler) => Some(CreditSaver::begin(
                &store,
                scheduler,
                config.credit_save_period_ms,
            )?),
            None => None,
        };
        let arbitration_status = crate::arbitration::SharedStatus::default();
        let arbitration =
            assembly::start_arbitration(&config, scheduler.as_ref(), &arbitration_status)?;
        let Listeners {
            doors,
            nbd_addr,
            nbd_unix,
            api_listener,
            api_addr,
        } = bind_listeners(&config).await?;
        let (stop, stop_rx) = watch::channel(false);
        let (nbd_stop, nbd_stop_rx) = watch::channel(false);

        let limits = &config.limits;
        let nofile = fd_limits::log_limits(limits);
        let api_connections = crate::api::conn::ApiConnections::new(api_limits_within(
            &config.api_limits,
            limits.max_connections,
            nofile,
        ));
        let (ctx, connections) = assembly::session_context(
            &config,
            &store,
            &io,
            scheduler.clone(),
            credentials.tls,
            &metrics,
        );
        let pipeline = Arc::clone(&ctx.pipeline);
        let budget = Arc::clone(&pipeline.budget);
        let buffers = Arc::clone(&io.buffers);
        let accept::Accepting {
            mut tasks,
            net_threads,
            connection_threads,
            threads_ended,
        } = accept::spawn(
            doors,
            ctx,
            Arc::clone(&connections),
            nbd_stop_rx,
            config.effective_net_threads(),
        )?;
        let timeline = crate::timeline::Timeline::new(
            crate::timeline::Sources {
                store: Arc::clone(&store),
                scheduler: scheduler.clone(),
                metrics: Some(Arc::clone(&metrics)),
            },
            crate::timeline::DEFAULT_SAMPLE_INTERVAL_MS,
        );
        let sampler_task = tokio::spawn(Arc::clone(&timeline).run(stop_rx.clone()));
        let (rebuild, scrub) = assembly::start_background(&config, &store, &io, &scheduler)?;
        let attachments = start_attachments(&store, &pipeline, net_threads).await;
        let api_state = crate::api::ApiState {
            rebuild: Some(rebuild),
            scrub: Some(scrub),
            store: Arc::clone(&store),
            scheduler: scheduler.clone(),
            connections: Arc::clone(&connections),
            budget,
            buffers,
            connection_threads,
            timeline,
            metrics,
            tokens: credentials.api_tokens,
            audit: credentials.audit,
            node: Arc::new(assembly::node_facts(&config, nbd_addr, api_addr)),
            arbitration: arbitration_status,
            api_connections,
            readiness: Arc::default(),
            attachments: Arc::clone(&attachments),
        };
        let api_task = tokio::spawn(crate::api::serve(api_listener, api_state.clone(), stop_rx));
        log_listeners(nbd_addr, nbd_unix.as_deref(), api_addr, &config);
        tasks.extend([api_task, sampler_task]);
        Ok(RunningNode {
            nbd_addr,
            nbd_unix,
            api_addr,
            store,
            scheduler,
            stop,
            nbd_stop,
            connections,
            pipeline,
            tasks,
            threads_ended,
            saver,
            arbitration,
            api_token: credentials.api_token,
            api_state,
            attachments,
        })
    }
}

/// The node's vhost-user-blk attachments, the stored ones served again; their queues on the
/// connection threads (`threads`, when there are any).
async fn start_attachments(
    store: &Arc<Store>,
    pipeline: &Arc<Pipeline>,
    threads: Option<Arc<crate::net_threads::NetThreads>>,
) -> Arc<crate::vhost_user::Attachments> {
    let attachments = Arc::new(crate::vhost_user::Attachments::new(
        Arc::clone(store),
        Arc::clone(pipeline),
        Box::new(vhost_socket::VhostSocketBinder),
        threads,
    ));
    attachments.restore().await;
    attachments
}

/// The node's listeners, bound.
struct Listeners {
    doors: Vec<accept::Door>,
    nbd_addr: Option<SocketAddr>,
    nbd_unix: Option<std::path::PathBuf>,
    api_listener: tokio::net::TcpListener,
    api_addr: SocketAddr,
}

/// Binds NBD's TCP listener (unless it is off), the API's, then NBD's Unix socket: last, so
/// a failure to bind another leaves no socket file behind.
async fn bind_listeners(config: &NodeConfig) -> Result<Listeners, NodeError> {
    let mut doors = Vec::new();
    let mut nbd_addr = None;
    if let Some(addr) = config.nbd_listen {
        let (listener, bound) = assembly::bind(addr).await?;
        doors.push(accept::Door::Tcp(listener));
        nbd_addr = Some(bound);
    }
    let (api_listener, api_addr) = assembly::bind(config.api_listen).await?;
    if let Some(unix) = &config.nbd_unix {
        let (listener, file) = unix_socket::bind(unix).await?;
        doors.push(accept::Door::Unix(accept::UnixDoor {
            listener,
            _file: file,
            tenants: unix.tenants.clone(),
        }));
    }
    Ok(Listeners {
        doors,
        nbd_addr,
        nbd_unix: config.nbd_unix.as_ref().map(|unix| unix.path.clone()),
        api_listener,
        api_addr,
    })
}

fn log_listeners(
    nbd_addr: Option<SocketAddr>,
    nbd_unix: Option<&std::path::Path>,
    api_addr: SocketAddr,
    config: &NodeConfig,
) {
    let tcp = nbd_addr.map_or_else(|| "off".to_owned(), |a| a.to_string());
    let policy = &config.qos.policy;
    match nbd_unix {
        Some(path) => tracing::info!(
            "NBD on {tcp} and unix:{}, API on http://{api_addr}, policy {policy}",
            path.display()
        ),
        None => tracing::info!("NBD on {tcp}, API on http://{api_addr}, policy {policy}"),
    }
}
