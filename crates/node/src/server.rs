//! Starting and stopping a node: open the store, bind the NBD and API listeners, accept
//! connections up to the limit, and on shutdown stop accepting and flush everything.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use headroom_store::{RadosTarget, Store, StoreConfig, StoreError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::{Admitted, Connections};
use crate::budget::Budget;
use crate::buffers::BufferPool;
use crate::clock::Clock;
use crate::config::{Limits, NodeConfig, StoreBackend};
use crate::emulated::EmulatedDevice;
use crate::exec::Lanes;
use crate::pipeline::{Emulation, IoJob, IoRunner, IoRuntime, Pipeline};
use crate::scheduler::{Scheduler, SchedulerError};
use crate::session::{SessionContext, SessionError, serve_connection};
use crate::sync::lock;
use crate::volume_qos::{CreditRecord, SAVE_MARGIN_PERIODS};

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
    pub nbd_addr: SocketAddr,
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
    saver: Option<CreditSaver>,
    arbitration: Option<crate::arbitration::Arbitration>,
    api_token: crate::api::ApiToken,
    /// What the API listener serves (`api_state`).
    api_state: crate::api::ApiState,
}

impl Node {
    /// Opens the store and starts both listeners.
    pub async fn start(config: NodeConfig) -> Result<RunningNode, NodeError> {
        config.validate()?;
        // Credentials first: a typo in a key file must not leave a half-started node.
        let tls = match &config.tls {
            None => None,
            Some(tls) => Some(Arc::new(tls_acceptor(tls, config.limits.ipv6_prefix_len)?)),
        };
        let api_token = match &config.api_token {
            Some(token) => token.clone(),
            None => crate::api::ApiToken::random().map_err(NodeError::Token)?,
        };
        let api_tokens = Arc::new(crate::api::tokens::Tokens::open(
            api_token.clone(),
            config.api_tokens_file.clone(),
        )?);
        let audit = match &config.audit_log {
            Some(path) => Some(crate::api::audit_log::AuditLog::open(path)?),
            None => None,
        };
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
        let store = Arc::new(store);
        let lanes = if config.io_threads == 0 {
            None
        } else {
            Some(Lanes::start(config.io_threads).map_err(NodeError::Workers)?)
        };
        let clock = Clock::new();
        let curve = config.emulated_curve.clone();
        let start_device = |spec| {
            EmulatedDevice::start_with_curve(spec, curve.clone(), clock)
                .map_err(|err| NodeError::Emulated(err.to_string()))
        };
        let emulation = match config.emulated_device {
            Some(spec) if spec.per_device => Emulation::PerDevice(
                (0..store.pool_info().devices.len())
                    .map(|_| start_device(spec))
                    .collect::<Result<_, _>>()?,
            ),
            Some(spec) => Emulation::Node(start_device(spec)?),
            None => Emulation::Off,
        };
        crate::coalesce::set_delay_us(config.effective_coalesce_us());
        let io = Arc::new(IoRuntime {
            lanes,
            inline_max_bytes: config.effective_inline_max_bytes(store.is_memory_resident()),
            buffers: Arc::new(BufferPool::new(config.limits.max_request_bytes as usize)),
            emulation,
            clock,
            runtime: tokio::runtime::Handle::current(),
            reads: crate::pipeline::ReadRouter::new(config.read_routing),
        });
        let metrics = crate::metrics::MetricsRegistry::new(config.metrics, clock);
        let scheduler = match config.qos.policy.kind() {
            None => None,
            Some(_) => {
                let runner = Arc::new(IoRunner(Arc::clone(&io)));
                let parallelism = io.emulation.parallelism();
                let scheduler = Scheduler::start(&config.qos, clock, runner, parallelism)?;
                register_volumes(&store, &scheduler)?;
                metrics.attach_scheduler(&scheduler);
                Some(scheduler)
            }
        };
        // Before any I/O: replace the exact balances of a clean shutdown by running ones, so
        // a crash from here on never finds more credit than was spent (volume_qos docs).
        let saver = match &scheduler {
            Some(scheduler) => {
                let period_ms = config.credit_save_period_ms.max(1);
                save_credits(&store, scheduler, false, period_ms)?;
                Some(CreditSaver::start(
                    Arc::clone(&store),
                    Arc::clone(scheduler),
                    period_ms,
                )?)
            }
            None => None,
        };
        let arbitration_status = crate::arbitration::SharedStatus::default();
        let arbitration = match (&config.arbitration, &config.backend, &scheduler) {
            (None, _, _) => None,
            (Some(arb), StoreBackend::Rados { conf, id, pool, .. }, Some(scheduler)) => {
                {
                    let mut s = lock(&arbitration_status);
                    s.enabled = true;
                    s.node_id = arb.node_id.clone();
                    s.weight = arb.weight;
                    s.epoch_ms = arb.epoch_ms;
                    s.capacity_units_per_s = arb.capacity_units_per_s();
                }
                Some(
                    crate::arbitration::Arbitration::start(
                        arb.clone(),
                        conf.clone(),
                        id.clone(),
                        pool.clone(),
                        Arc::clone(scheduler),
                        Arc::clone(&arbitration_status),
                    )
                    .map_err(NodeError::Workers)?,
                )
            }
            (Some(_), StoreBackend::Rados { .. }, None) => {
                return Err(NodeError::Arbitration(
                    "needs a scheduling policy (qos.policy is off)".into(),
                ));
            }
            (Some(_), _, _) => {
                return Err(NodeError::Arbitration(
                    "needs the RADOS backend (--rados-conf, --rados-pool)".into(),
                ));
            }
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
        let (nbd_stop, nbd_stop_rx) = watch::channel(false);

        let limits = &config.limits;
        let nofile = log_limits(limits);
        let api_connections = crate::api::conn::ApiConnections::new(api_limits_within(
            &config.api_limits,
            limits.max_connections,
            nofile,
        ));
        let budget = Budget::with_reserve(
            limits.max_inflight_bytes_per_tenant,
            limits.max_inflight_bytes_per_node,
            limits.reserved_inflight_bytes_per_conn(),
            limits.max_connections,
        );
        let connections = Connections::with_ipv6_prefix(
            limits.max_connections,
            limits.max_connections_per_ip,
            limits.ipv6_prefix_len,
        );
        let pipeline = Arc::new(Pipeline {
            limits: config.limits.clone(),
            io: Arc::clone(&io),
            scheduler: scheduler.clone(),
            budget: Arc::clone(&budget),
            metrics: Arc::clone(&metrics),
        });
        let ctx = Arc::new(SessionContext {
            store: Arc::clone(&store),
            pipeline: Arc::clone(&pipeline),
            tls,
            tls_required: config.tls.as_ref().is_some_and(|tls| tls.required),
        });
        let buffers = Arc::clone(&io.buffers);
        let net_threads = match config.effective_net_threads() {
            0 => None,
            n => Some(crate::net_threads::NetThreads::start(n).map_err(NodeError::Workers)?),
        };
        let connection_threads = net_threads
            .as_ref()
            .map(crate::net_threads::NetThreads::open_connections)
            .unwrap_or_default();
        match &net_threads {
            Some(t) => tracing::info!(
                "connection threads: {} (each connection stays on one)",
                t.len()
            ),
            None => tracing::info!("connection threads: none (connections share the runtime)"),
        }
        let accept_task = tokio::spawn(accept_loop(
            nbd_listener,
            ctx,
            Arc::clone(&connections),
            nbd_stop_rx,
            net_threads,
        ));
        let timeline = crate::timeline::Timeline::new(
            crate::timeline::Sources {
                store: Arc::clone(&store),
                scheduler: scheduler.clone(),
                metrics: Some(Arc::clone(&metrics)),
            },
            crate::timeline::DEFAULT_SAMPLE_INTERVAL_MS,
        );
        let sampler_task = tokio::spawn(Arc::clone(&timeline).run(stop_rx.clone()));
        let rebuild = crate::repair::Rebuilder::start(
            &store,
            config.rebuild_rate_bytes_per_s,
            config.fail_device_after_errors,
            scheduler.clone().map(|s| (Arc::clone(&io), s)),
        )
        .map_err(NodeError::Workers)?;
        let scrub = crate::scrub::Scrubber::start(
            &store,
            config.scrub_rate_bytes_per_s,
            config.scrub_interval_s,
            match &config.backend {
                StoreBackend::Files { data_dir, .. } | StoreBackend::Rados { data_dir, .. } => {
                    Some(data_dir.join("scrub-state.json"))
                }
                StoreBackend::Memory { .. } => None,
            },
            scheduler.clone().map(|s| (Arc::clone(&io), s)),
        )
        .map_err(NodeError::Workers)?;
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
            tokens: api_tokens,
            audit,
            node: Arc::new(node_facts(&config, nbd_addr, api_addr)),
            arbitration: arbitration_status,
            api_connections,
            readiness: Arc::default(),
        };
        let api_task = tokio::spawn(crate::api::serve(api_listener, api_state.clone(), stop_rx));
        tracing::info!(
            "NBD on {nbd_addr}, API on http://{api_addr}, policy {}",
            config.qos.policy
        );
        Ok(RunningNode {
            nbd_addr,
            api_addr,
            store,
            scheduler,
            stop,
            nbd_stop,
            connections,
            pipeline,
            tasks: vec![accept_task, api_task, sampler_task],
            saver,
            arbitration,
            api_token,
            api_state,
        })
    }
}

/// What `GET /v1/node` shows about how the node was started.
fn node_facts(
    config: &NodeConfig,
    nbd_addr: SocketAddr,
    api_addr: SocketAddr,
) -> crate::api::node::NodeFacts {
    let mut facts = crate::api::node::NodeFacts::now(nbd_addr, api_addr);
    match &config.backend {
        StoreBackend::Files { data_dir, .. } => {
            facts.backend = "files";
            facts.data_dir = Some(data_dir.clone());
        }
        StoreBackend::Rados { data_dir, .. } => {
            facts.backend = "rados";
            facts.data_dir = Some(data_dir.clone());
        }
        StoreBackend::Memory { .. } => {}
    }
    facts.io_threads = config.io_threads;
    facts.tls = config.tls.is_some();
    facts.config_file = config.config_file.clone();
    facts.calibration_file = config.calibration_file.clone();
    facts
}

#[cfg(feature = "tls")]
fn tls_acceptor(
    config: &crate::config::TlsConfig,
    ipv6_prefix_len: u8,
) -> Result<crate::session::Tls, NodeError> {
    Ok(crate::tls::TlsAcceptor::new(config)?.with_handshake_limit(
        crate::handshake_limit::HandshakeLimiter::new(
            config.handshakes_per_s_per_address,
            ipv6_prefix_len,
        ),
    ))
}

#[cfg(not(feature = "tls"))]
fn tls_acceptor(
    _config: &crate::config::TlsConfig,
    _ipv6_prefix_len: u8,
) -> Result<crate::session::Tls, NodeError> {
    Err(NodeError::TlsUnavailable)
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

    /// Creates a volume with a QoS class (none: unlimited) and registers it with the
    /// scheduler, as `POST /v1/volumes` does. Blocking (a durable metadata commit).
    pub fn create_volume(
        &self,
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
        let info = self
            .store
            .create_volume_with_qos(name, size_bytes, record)?;
        if let Some(scheduler) = &self.scheduler {
            let qos = stored.map_or_else(headroom_qos::VolumeQos::default, |s| s.qos);
            scheduler.add_volume(info.id, &qos);
        }
        Ok(info)
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
        tokio::task::spawn_blocking(move || {
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

async fn accept_loop(
    listener: TcpListener,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
    // Dropped when the loop ends: the threads then close their connections and end.
    net_threads: Option<crate::net_threads::NetThreads>,
) {
    let mut backoff = AcceptBackoff::default();
    let mut refusals = Sampled::default();
    let mut evictions = Sampled::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => {
                backoff.succeeded();
                pair
            }
            Err(err) => {
                connections.note_accept_error();
                // EMFILE and friends: keep serving the connections we have, and try again
                // later instead of spinning on a listener that stays readable.
                if let Some(delay) = backoff.failed(&err) {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => break,
                    }
                }
                continue;
            }
        };
        let admitted = match connections.admit(peer) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                if let Some(more) = refusals.sample() {
                    tracing::warn!("refusing {peer}: {refusal} ({more} more refused before)");
                }
                drop(stream);
                continue;
            }
        };
        if let Some(evicted) = admitted.evicted
            && let Some(more) = evictions.sample()
        {
            tracing::info!(
                "closed {evicted}, still negotiating, to make room for {peer} ({more} more evicted before)"
            );
        }
        let ctx = Arc::clone(&ctx);
        let Some(threads) = &net_threads else {
            tokio::spawn(run_session(stream, peer, ctx, admitted));
            continue;
        };
        // The socket moves to the chosen thread's reactor: deregistered here, registered there.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(err) => {
                tracing::info!("session with {peer} ended: {err}");
                continue;
            }
        };
        let placed = threads.spawn(move || async move {
            match TcpStream::from_std(stream) {
                Ok(stream) => run_session(stream, peer, ctx, admitted).await,
                Err(err) => tracing::info!("session with {peer} ended: {err}"),
            }
        });
        if placed.is_none() {
            tracing::error!("no connection thread took {peer}: closed");
        }
    }
}

/// One connection from admission to close, on whichever thread runs it.
async fn run_session(
    stream: TcpStream,
    peer: SocketAddr,
    ctx: Arc<SessionContext>,
    admitted: Admitted,
) {
    let shared = Arc::clone(admitted.shared());
    if let Err(err) = stream.set_nodelay(true) {
        tracing::info!("session with {peer} ended: {}", SessionError::from(err));
        return;
    }
    let served = tokio::select! {
        served = serve_connection(stream, ctx, &admitted) => served,
        () = shared.evicted() => Err(SessionError::Evicted),
    };
    match served {
        Ok(()) => {}
        Err(SessionError::Evicted) => {
            tracing::debug!("session with {peer} ended: {}", SessionError::Evicted);
        }
        Err(err) => tracing::info!("session with {peer} ended: {err}"),
    }
    drop(admitted);
}

/// Delays between failed `accept` calls: none for errors of one connection (it was reset or
/// aborted before we took it), otherwise 10 ms doubling to 1 s until one succeeds. Logs once
/// when a run of failures starts and once when it ends.
#[derive(Debug, Default)]
struct AcceptBackoff {
    failures: u64,
    delay: Option<Duration>,
    since: Option<Instant>,
}

const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

impl AcceptBackoff {
    fn failed(&mut self, err: &std::io::Error) -> Option<Duration> {
        use std::io::ErrorKind;
        if matches!(
            err.kind(),
            ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted
        ) {
            tracing::debug!("accept failed: {err}");
            return None;
        }
        self.failures += 1;
        let delay = match self.delay {
            None => {
                tracing::warn!(
                    "accept failed: {err}; retrying after 10 ms, doubling up to 1 s, until it \
                     works (open connections are served meanwhile)"
                );
                self.since = Some(Instant::now());
                ACCEPT_BACKOFF_FIRST
            }
            Some(delay) => (delay * 2).min(ACCEPT_BACKOFF_MAX),
        };
        self.delay = Some(delay);
        Some(delay)
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            let ms = self.since.map_or(0, |t| t.elapsed().as_millis());
            tracing::warn!(
                "accept works again after {} failed attempts in {ms} ms",
                self.failures
            );
        }
        *self = AcceptBackoff::default();
    }
}

/// Logs the first of a run of events and then at most one per second, with the count of those
/// not logged, so a flood of connections cannot flood the log.
#[derive(Debug, Default)]
struct Sampled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Sampled {
    /// `Some(events not logged since the last one logged)` when this one should be logged.
    fn sample(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < Duration::from_secs(1) => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}

/// File descriptors the node keeps for itself besides one per NBD and API connection: device
/// files, metadata and its copy, the audit log, listeners, the runtime's own, and the sockets
/// `accept` takes before admission closes them.
pub const FD_RESERVE: u64 = 256;

/// Logs the limits in force, raises the soft RLIMIT_NOFILE to the hard limit (the API's
/// connection cap is then fitted under it, `api_limits_within`), and warns when that is not
/// enough for NBD or when the byte budget is more memory than the machine has. Returns the
/// soft limit in force (`None`: unknown).
fn log_limits(limits: &Limits) -> Option<u64> {
    let mib = |bytes: u64| bytes >> 20;
    tracing::info!(
        "limits: payload in flight at most {} MiB per node, {} MiB per tenant, {} MiB per \
         connection, {} KiB of it reserved for each connection; {} connections, {} per \
         address; {} requests in flight per connection",
        mib(limits.max_inflight_bytes_per_node),
        mib(limits.max_inflight_bytes_per_tenant),
        mib(limits.max_inflight_bytes_per_conn),
        limits.reserved_inflight_bytes_per_conn() >> 10,
        limits.max_connections,
        limits.max_connections_per_ip,
        limits.max_inflight_requests_per_conn,
    );
    let needed = u64::try_from(limits.max_connections)
        .unwrap_or(u64::MAX)
        .saturating_add(FD_RESERVE);
    let soft = match raise_nofile(u64::MAX) {
        Ok(soft) => {
            if soft < needed {
                tracing::warn!(
                    "RLIMIT_NOFILE allows {soft} open files, fewer than limits.max_connections \
                     ({}) + {FD_RESERVE}: accept will fail with EMFILE before the connection cap \
                     (it backs off and retries); raise the hard limit (ulimit -Hn, \
                     LimitNOFILE=) or lower max_connections",
                    limits.max_connections
                );
            }
            Some(soft)
        }
        Err(err) => {
            tracing::warn!("reading RLIMIT_NOFILE: {err}");
            None
        }
    };
    if let Some(total) = mem_total_bytes()
        && limits.max_inflight_bytes_per_node > total / 2
    {
        tracing::warn!(
            "limits.max_inflight_bytes_per_node ({} MiB) is more than half of this machine's \
             memory ({} MiB)",
            mib(limits.max_inflight_bytes_per_node),
            mib(total)
        );
    }
    soft
}

/// The API's limits with its connection cap lowered, if need be, so that API connections
/// can never take the descriptors NBD and the store need: at most
/// `soft limit - NBD max_connections - FD_RESERVE` (and at least 16, so the API stays usable
/// on a tiny limit; NBD then gets fewer than it asked for, which `log_limits` warned about).
pub fn api_limits_within(
    configured: &crate::api::conn::ApiLimits,
    nbd_max_connections: usize,
    nofile_soft: Option<u64>,
) -> crate::api::conn::ApiLimits {
    let mut limits = configured.clone();
    let Some(soft) = nofile_soft else {
        return limits;
    };
    let nbd = u64::try_from(nbd_max_connections).unwrap_or(u64::MAX);
    let room = soft.saturating_sub(nbd).saturating_sub(FD_RESERVE).max(16);
    let room = usize::try_from(room).unwrap_or(usize::MAX);
    if limits.max_connections > room {
        tracing::warn!(
            "api.max_connections lowered from {} to {room}: RLIMIT_NOFILE is {soft}, of which \
             limits.max_connections ({nbd_max_connections}) and {FD_RESERVE} are kept for NBD \
             and the store",
            limits.max_connections
        );
        limits.max_connections = room;
    }
    tracing::info!(
        "API: at most {} connections; head {} ms, body {} ms, idle {} ms",
        limits.max_connections,
        limits.header_read_timeout_ms,
        limits.body_read_timeout_ms,
        limits.idle_timeout_ms
    );
    limits
}

/// Raises the soft limit on open files to `needed` if the hard limit allows (else to the hard
/// limit); returns the soft limit in force.
fn raise_nofile(needed: u64) -> std::io::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if soft >= needed {
        return Ok(soft);
    }
    // No hard limit (RLIM_INFINITY) still caps descriptors at fs.nr_open (2^20 by default).
    let target = limit.maximum.unwrap_or(1 << 20).min(needed);
    if target <= soft {
        return Ok(soft);
    }
    let raised = rustix::process::Rlimit {
        current: Some(target),
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, raised).map_err(std::io::Error::from)?;
    tracing::info!("raised RLIMIT_NOFILE from {soft} to {target}");
    Ok(target)
}

/// `MemTotal` from /proc/meminfo.
fn mem_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Registers every stored volume with the scheduler and restores its saved credit balance.
fn register_volumes(store: &Store, scheduler: &Scheduler<IoJob>) -> Result<(), NodeError> {
    let saved: std::collections::HashMap<u64, CreditRecord> = store
        .volume_states()?
        .into_iter()
        .filter_map(|(id, bytes)| CreditRecord::from_bytes(&bytes).map(|r| (id, r)))
        .collect();
    for info in store.list_volumes() {
        let qos = crate::volume_qos::effective_qos(info.qos.as_deref(), info.size_bytes);
        let handle = scheduler.add_volume(info.id, &qos);
        if let Some(record) = saved.get(&info.id) {
            scheduler.restore_credits(&handle, record.iops_credits, record.bytes_credits);
        }
    }
    Ok(())
}

/// Saves the credit balance of every volume that has credit buckets: exact when `clean`,
/// otherwise less what it could spend in `SAVE_MARGIN_PERIODS × period_ms`.
fn save_credits(
    store: &Store,
    scheduler: &Scheduler<IoJob>,
    clean: bool,
    period_ms: u64,
) -> Result<(), NodeError> {
    let margin_ms = period_ms.saturating_mul(SAVE_MARGIN_PERIODS);
    let mut rows = Vec::new();
    for info in store.list_volumes() {
        let Some(handle) = scheduler.handle(info.id) else {
            continue;
        };
        let qos = handle.qos();
        if !matches!(qos.burst, headroom_qos::BurstMode::Credits(_)) {
            continue;
        }
        let balances = scheduler.credits(&handle);
        let record = CreditRecord::for_save(&qos, balances, clean, margin_ms);
        rows.push((info.id, record.to_bytes()));
    }
    if rows.is_empty() {
        return Ok(());
    }
    store.save_volume_states(&rows).map_err(NodeError::Credits)
}

/// The thread that saves credit balances while the node runs.
#[derive(Debug)]
struct CreditSaver {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CreditSaver {
    fn start(
        store: Arc<Store>,
        scheduler: Arc<Scheduler<IoJob>>,
        period_ms: u64,
    ) -> Result<CreditSaver, NodeError> {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let flag = Arc::clone(&stop);
        let late_warned = AtomicBool::new(false);
        let thread = std::thread::Builder::new()
            .name("headroom-credits".into())
            .spawn(move || {
                let period = Duration::from_millis(period_ms);
                let clock = scheduler.clock();
                let mut next_ns = clock.now_ns() + period_ms * 1_000_000;
                loop {
                    let (stop, changed) = &*flag;
                    let mut stopped = lock(stop);
                    while !*stopped && clock.now_ns() < next_ns {
                        let wait = clock.until(next_ns).min(period);
                        stopped = changed
                            .wait_timeout(stopped, wait)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    if *stopped {
                        return;
                    }
                    drop(stopped);
                    let late_ns = clock.now_ns().saturating_sub(next_ns);
                    if late_ns > period_ms * 1_000_000 && !late_warned.swap(true, Ordering::Relaxed)
                    {
                        tracing::warn!(
                            "credit balances saved {} ms late: a crash now could restore more credit than was spent",
                            late_ns / 1_000_000
                        );
                    }
                    if let Err(err) = save_credits(&store, &scheduler, false, period_ms) {
                        tracing::error!("{err}");
                    }
                    next_ns = clock.now_ns() + period_ms * 1_000_000;
                }
            })
            .map_err(NodeError::Workers)?;
        Ok(CreditSaver {
            stop,
            thread: Some(thread),
        })
    }

    fn stop(mut self) {
        let (flag, changed) = &*self.stop;
        *lock(flag) = true;
        changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::conn::ApiLimits;

    #[test]
    fn the_api_cap_leaves_nbd_and_the_store_their_descriptors() {
        let configured = ApiLimits::default();
        let cap = |nbd, soft| api_limits_within(&configured, nbd, soft).max_connections;
        // Room enough: as configured.
        assert_eq!(cap(256, Some(65_536)), 1024);
        assert_eq!(cap(256, Some(1024 + 256 + 256)), 1024);
        // Too little: what NBD and the reserve leave.
        assert_eq!(cap(256, Some(1024)), 1024 - 256 - 256);
        assert_eq!(cap(4096, Some(4096 + 256 + 100)), 100);
        // Never below 16 (the API stays usable); unknown limit: as configured.
        assert_eq!(cap(256, Some(64)), 16);
        assert_eq!(cap(256, None), 1024);
    }
}
