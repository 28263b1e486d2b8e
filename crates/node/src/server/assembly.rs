//! The parts of a node, built in the order [`super::Node::start`] needs them: credentials,
//! the I/O runtime (executor lanes, emulated devices), the scheduler with every stored volume
//! registered, cross-node arbitration, the listeners, the context every session shares, and
//! the background work (rebuild, scrub). Each step fails the start with a [`NodeError`]
//! before anything is served.

use std::net::SocketAddr;
use std::sync::Arc;

use headroom_store::Store;
use tokio::net::TcpListener;

use super::NodeError;
use super::credits::register_volumes;
use crate::admission::Connections;
use crate::budget::Budget;
use crate::buffers::BufferPool;
use crate::clock::Clock;
use crate::config::{NodeConfig, StoreBackend};
use crate::emulated::EmulatedDevice;
use crate::exec::Lanes;
use crate::metrics::MetricsRegistry;
use crate::pipeline::{Emulation, IoJob, IoRunner, IoRuntime, Pipeline};
use crate::scheduler::Scheduler;
use crate::session::SessionContext;
use crate::sync::lock;

/// What the node is reached and trusted by, read before anything starts.
pub(super) struct Credentials {
    pub(super) tls: Option<Arc<crate::session::Tls>>,
    pub(super) api_token: crate::api::ApiToken,
    pub(super) api_tokens: Arc<crate::api::tokens::Tokens>,
    pub(super) audit: Option<Arc<crate::api::audit_log::AuditLog>>,
}

impl Credentials {
    /// The TLS acceptor, the API's bearer token (random if none is configured), its token
    /// file and its audit log.
    pub(super) fn load(config: &NodeConfig) -> Result<Credentials, NodeError> {
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
        Ok(Credentials {
            tls,
            api_token,
            api_tokens,
            audit,
        })
    }
}

/// The I/O runtime: executor lanes, the emulated devices, buffers, the read router.
pub(super) fn start_io(
    config: &NodeConfig,
    store: &Store,
    clock: Clock,
) -> Result<Arc<IoRuntime>, NodeError> {
    let lanes = if config.io_threads == 0 {
        None
    } else {
        Some(Lanes::start(config.io_threads).map_err(NodeError::Workers)?)
    };
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
    Ok(Arc::new(IoRuntime {
        lanes,
        inline_max_bytes: config.effective_inline_max_bytes(store.is_memory_resident()),
        buffers: Arc::new(BufferPool::new(config.limits.max_request_bytes as usize)),
        emulation,
        clock,
        runtime: tokio::runtime::Handle::current(),
        reads: crate::pipeline::ReadRouter::new(config.read_routing),
        work: Default::default(),
    }))
}

/// The scheduler, if a policy is on, with every stored volume registered and its saved
/// balance restored.
pub(super) fn start_scheduler(
    config: &NodeConfig,
    store: &Store,
    io: &Arc<IoRuntime>,
    metrics: &MetricsRegistry,
) -> Result<Option<Arc<Scheduler<IoJob>>>, NodeError> {
    if config.qos.policy.kind().is_none() {
        return Ok(None);
    }
    let runner = Arc::new(IoRunner(Arc::clone(io)));
    let parallelism = io.emulation.parallelism();
    let scheduler = Scheduler::start(&config.qos, io.clock, runner, parallelism)?;
    register_volumes(store, &scheduler)?;
    metrics.attach_scheduler(&scheduler);
    Ok(Some(scheduler))
}

/// Cross-node arbitration, if configured: it needs the RADOS backend and a policy.
pub(super) fn start_arbitration(
    config: &NodeConfig,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    status: &crate::arbitration::SharedStatus,
) -> Result<Option<crate::arbitration::Arbitration>, NodeError> {
    let arbitration = match (&config.arbitration, &config.backend, scheduler) {
        (None, _, _) => None,
        (Some(arb), StoreBackend::Rados { conf, id, pool, .. }, Some(scheduler)) => {
            {
                let mut s = lock(status);
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
                    Arc::clone(status),
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
    Ok(arbitration)
}

/// Binds a listener; returns it and the address it is bound to (the port, when 0 was asked).
pub(super) async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), NodeError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Bind { addr, source })?;
    let local = local_addr(&listener, addr)?;
    Ok((listener, local))
}

/// What every session shares: the store, the limits and budgets, the I/O runtime, the
/// scheduler, TLS and the metrics; and the connection table it is admitted by.
pub(super) fn session_context(
    config: &NodeConfig,
    store: &Arc<Store>,
    io: &Arc<IoRuntime>,
    scheduler: Option<Arc<Scheduler<IoJob>>>,
    tls: Option<Arc<crate::session::Tls>>,
    metrics: &Arc<MetricsRegistry>,
) -> (Arc<SessionContext>, Arc<Connections>) {
    let limits = &config.limits;
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
        io: Arc::clone(io),
        scheduler,
        budget,
        metrics: Arc::clone(metrics),
    });
    let ctx = Arc::new(SessionContext {
        store: Arc::clone(store),
        pipeline,
        tls,
        tls_required: config.tls.as_ref().is_some_and(|tls| tls.required),
    });
    (ctx, connections)
}

/// The background work: the rebuilder and the scrubber, scheduled like client I/O when a
/// policy is on.
pub(super) fn start_background(
    config: &NodeConfig,
    store: &Arc<Store>,
    io: &Arc<IoRuntime>,
    scheduler: &Option<Arc<Scheduler<IoJob>>>,
) -> Result<(Arc<crate::repair::Rebuilder>, Arc<crate::scrub::Scrubber>), NodeError> {
    let rebuild = crate::repair::Rebuilder::start(
        store,
        config.rebuild_rate_bytes_per_s,
        config.fail_device_after_errors,
        scheduler.clone().map(|s| (Arc::clone(io), s)),
    )
    .map_err(NodeError::Workers)?;
    let scrub = crate::scrub::Scrubber::start(
        store,
        config.scrub_rate_bytes_per_s,
        config.scrub_interval_s,
        match &config.backend {
            StoreBackend::Files { data_dir, .. } | StoreBackend::Rados { data_dir, .. } => {
                Some(data_dir.join("scrub-state.json"))
            }
            StoreBackend::Memory { .. } => None,
        },
        scheduler.clone().map(|s| (Arc::clone(io), s)),
    )
    .map_err(NodeError::Workers)?;
    Ok((rebuild, scrub))
}

/// What `GET /v1/node` shows about how the node was started.
pub(super) fn node_facts(
    config: &NodeConfig,
    nbd_addr: Option<SocketAddr>,
    api_addr: SocketAddr,
) -> crate::api::node::NodeFacts {
    let mut facts = crate::api::node::NodeFacts::now(nbd_addr, api_addr);
    facts.nbd_unix = config.nbd_unix.as_ref().map(|unix| unix.path.clone());
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
