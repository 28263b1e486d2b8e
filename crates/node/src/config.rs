//! Node configuration: where data lives, where we listen, and the limits that bound what one
//! client can make us hold. Defaults are the ones the CLI contract promises.

use std::net::SocketAddr;
use std::path::PathBuf;

use headroom_qos::{CostModel, CostVector, NS_PER_S, NodeCapacity, PolicyKind, PolicyParams};
use serde::{Deserialize, Serialize};

use crate::emulated::EmulatedDeviceSpec;

/// Where volume data and metadata are kept.
#[derive(Clone, Debug)]
pub enum StoreBackend {
    /// Sparse device files and a redb database under a data directory.
    Files {
        data_dir: PathBuf,
        /// Sparse device files created in a new data directory.
        device_count: u32,
        device_capacity_bytes: u64,
        /// Existing block devices or files to use instead of created device files.
        device_paths: Vec<PathBuf>,
    },
    /// Everything in RAM (tests and protocol benchmarks); lost on exit.
    Memory { capacity_bytes: u64 },
    /// Extents as objects of a Ceph RADOS pool, metadata (redb) under a data directory; the
    /// store refuses it unless built with the `rados` feature.
    Rados {
        data_dir: PathBuf,
        /// The cluster's `ceph.conf`.
        conf: PathBuf,
        /// The cephx user, without `client.` (`headroom_store::RadosTarget::id`).
        id: String,
        pool: String,
        /// Address space extents are allocated from (the pool device's capacity).
        capacity_bytes: u64,
        /// The namespace of an existing store to open (`None`: the data directory's, or new).
        namespace: Option<String>,
        /// The lease's duration (`headroom_store::RadosTarget::lease_ms`).
        lease_ms: u64,
        /// How long to wait at start for another node's lease (`None`: as long as it takes).
        lease_wait_ms: Option<u64>,
        /// After losing the lease, how long the process keeps answering the API (`/readyz`
        /// 503) before it exits with `headroom_store::LEASE_LOST_EXIT_STATUS`.
        lease_lost_linger_ms: u64,
    },
}

/// Bounds on what clients can make the server hold.
///
/// Payload bytes in flight are bounded at three levels, each at most the next
/// ([`Limits::validate`]): a connection, a tenant (every connection to the volumes of one
/// tenant, "no tenant" being one), and the node. A request is charged the buffer it occupies
/// ([`crate::buffers::BufferPool::charge_bytes`]: its length rounded up to a power of two, at
/// least 4 KiB) from the moment its header is read until its reply is on the wire.
#[derive(Clone, Debug)]
pub struct Limits {
    /// NBD connections served at once. At the limit a new connection evicts the connection
    /// still negotiating from the address with the most negotiating connections (the oldest of
    /// them), or is closed right after accept when every connection is transmitting.
    pub max_connections: usize,
    /// Connections from one client address at once; at the limit a new one evicts that
    /// address's oldest connection still negotiating, or is closed.
    pub max_connections_per_ip: usize,
    /// IPv6 clients whose addresses share this many leading bits are one client address for
    /// `max_connections_per_ip` (1-128; 64 by default: a host normally holds a whole /64).
    /// IPv4 clients count by address.
    pub ipv6_prefix_len: u8,
    /// Requests read from one connection but not yet answered.
    pub max_inflight_requests_per_conn: usize,
    /// Payload bytes (write data read, read data not yet sent) held per connection.
    pub max_inflight_bytes_per_conn: u64,
    /// Payload bytes held by all connections of one tenant together.
    pub max_inflight_bytes_per_tenant: u64,
    /// Payload bytes held by all connections of the node together: the memory budget.
    pub max_inflight_bytes_per_node: u64,
    /// Largest READ/WRITE payload, advertised as the maximum block size.
    pub max_request_bytes: u32,
    /// Time a client has to finish option negotiation.
    pub handshake_timeout_ms: u64,
    /// A reply the client takes no byte of, or a WRITE payload it sends no byte of, for this
    /// long ends the session: the client stopped reading (or sending), and the bytes its
    /// requests hold go back to the others.
    pub client_stall_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            max_connections_per_ip: 256,
            ipv6_prefix_len: crate::address_group::DEFAULT_IPV6_PREFIX_LEN,
            max_inflight_requests_per_conn: 256,
            max_inflight_bytes_per_conn: 128 << 20,
            max_inflight_bytes_per_tenant: 256 << 20,
            max_inflight_bytes_per_node: 1 << 30,
            max_request_bytes: 32 << 20,
            handshake_timeout_ms: 30_000,
            client_stall_timeout_ms: 60_000,
        }
    }
}

/// A combination of limits the node cannot serve with: the key (as in the `[limits]` table),
/// its value, and the rule it breaks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("limits.{key} = {value}: {rule}")]
pub struct LimitsError {
    pub key: &'static str,
    /// The value: a count, milliseconds, or bytes (see the key's unit).
    pub value: u64,
    pub rule: LimitRule,
}

/// What a limit must be. `Display` gives sizes in bytes; `headroom serve` words them with units.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitRule {
    #[error("must be between {min} and {max}")]
    Between { min: u64, max: u64 },
    #[error("must be between 1 and limits.{outer} ({outer_value})")]
    AtMostOuterCount {
        outer: &'static str,
        outer_value: u64,
    },
    #[error(
        "must be at least {charge_bytes} bytes, the buffer a request of limits.max_request_bytes \
         ({request_bytes} bytes) occupies, or such a request would wait forever"
    )]
    HoldsLargestRequest {
        request_bytes: u64,
        charge_bytes: u64,
    },
    #[error("must be at most limits.{outer} ({outer_bytes} bytes)")]
    AtMostOuterBytes {
        outer: &'static str,
        outer_bytes: u64,
    },
}

/// Most requests in flight per connection a configuration may allow.
pub const MAX_INFLIGHT_REQUESTS_PER_CONN: u64 = 65_536;
/// Longest negotiation deadline and client stall timeout a configuration may set (one hour).
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;

/// The share of `max_inflight_bytes_per_node` kept in per-connection reserves (1/4).
pub const RESERVED_SHARE_OF_NODE_DIVISOR: u64 = 4;

impl Limits {
    /// What each connection may always hold outside the shared pool (`node::budget`): a
    /// quarter of the node budget split between `max_connections`, rounded down to a power
    /// of two (the size of a buffer class), at most the buffer of the largest request and the
    /// connection's own bound, and never so much that the shared pool left could not hold
    /// the largest request. 1 MiB with the defaults (1 GiB, 256 connections). Derived rather
    /// than configured: the two limits it follows from are the ones an operator sets.
    pub fn reserved_inflight_bytes_per_conn(&self) -> u64 {
        let connections = u64::try_from(self.max_connections.max(1)).unwrap_or(u64::MAX);
        let largest = crate::buffers::BufferPool::charge_bytes(self.max_request_bytes);
        let share = self.max_inflight_bytes_per_node / RESERVED_SHARE_OF_NODE_DIVISOR;
        let room = self.max_inflight_bytes_per_node.saturating_sub(largest);
        let bytes = (share.min(room) / connections)
            .min(largest)
            .min(self.max_inflight_bytes_per_conn);
        // A reserve smaller than the smallest charge would never be used.
        if bytes < crate::buffers::BufferPool::charge_bytes(1) {
            return 0;
        }
        1 << bytes.ilog2()
    }

    /// Checks every bound, and that each byte limit holds the largest request and fits in the
    /// next wider one (the buffer of the largest request ≤ per connection ≤ per tenant ≤ per
    /// node), so that no request waits for a budget it could never get.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let fail =
            |key: &'static str, value: u64, rule: LimitRule| Err(LimitsError { key, value, rule });
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        let max_connections = count(self.max_connections);
        if max_connections == 0 {
            let rule = LimitRule::Between {
                min: 1,
                max: u64::from(u32::MAX),
            };
            return fail("max_connections", 0, rule);
        }
        let per_ip = count(self.max_connections_per_ip);
        if !(1..=max_connections).contains(&per_ip) {
            let rule = LimitRule::AtMostOuterCount {
                outer: "max_connections",
                outer_value: max_connections,
            };
            return fail("max_connections_per_ip", per_ip, rule);
        }
        if !(1..=128).contains(&self.ipv6_prefix_len) {
            let rule = LimitRule::Between { min: 1, max: 128 };
            return fail("ipv6_prefix_len", u64::from(self.ipv6_prefix_len), rule);
        }
        let requests = count(self.max_inflight_requests_per_conn);
        if !(1..=MAX_INFLIGHT_REQUESTS_PER_CONN).contains(&requests) {
            let rule = LimitRule::Between {
                min: 1,
                max: MAX_INFLIGHT_REQUESTS_PER_CONN,
            };
            return fail("max_inflight_requests", requests, rule);
        }
        let request_bytes = u64::from(self.max_request_bytes);
        let max_payload = u64::from(headroom_nbd::MAX_PAYLOAD_BYTES);
        if !(1..=max_payload).contains(&request_bytes) {
            let rule = LimitRule::Between {
                min: 1,
                max: max_payload,
            };
            return fail("max_request_bytes", request_bytes, rule);
        }
        let charge_bytes = crate::buffers::BufferPool::charge_bytes(self.max_request_bytes);
        let levels: [(&'static str, u64); 3] = [
            ("max_inflight_bytes", self.max_inflight_bytes_per_conn),
            (
                "max_inflight_bytes_per_tenant",
                self.max_inflight_bytes_per_tenant,
            ),
            (
                "max_inflight_bytes_per_node",
                self.max_inflight_bytes_per_node,
            ),
        ];
        for (key, bytes) in levels {
            if bytes < charge_bytes {
                let rule = LimitRule::HoldsLargestRequest {
                    request_bytes,
                    charge_bytes,
                };
                return fail(key, bytes, rule);
            }
        }
        for (&(inner, inner_bytes), &(outer, outer_bytes)) in
            levels.iter().zip(levels.iter().skip(1))
        {
            if inner_bytes > outer_bytes {
                let rule = LimitRule::AtMostOuterBytes { outer, outer_bytes };
                return fail(inner, inner_bytes, rule);
            }
        }
        // The per-connection byte budget is a semaphore of u32 permits.
        let per_conn_max = u64::from(u32::MAX);
        if self.max_inflight_bytes_per_conn > per_conn_max {
            let rule = LimitRule::Between {
                min: charge_bytes,
                max: per_conn_max,
            };
            return fail("max_inflight_bytes", self.max_inflight_bytes_per_conn, rule);
        }
        for (key, ms) in [
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("client_stall_timeout_ms", self.client_stall_timeout_ms),
        ] {
            if !(1..=MAX_TIMEOUT_MS).contains(&ms) {
                let rule = LimitRule::Between {
                    min: 1,
                    max: MAX_TIMEOUT_MS,
                };
                return fail(key, ms, rule);
            }
        }
        Ok(())
    }
}

/// TLS on the NBD port (`NBD_OPT_STARTTLS`). Needs the `tls` cargo feature.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// `identity:hexkey` lines (qemu's `keys.psk`).
    pub psk_file: Option<PathBuf>,
    /// qemu's X.509 layout: `server-cert.pem`, `server-key.pem`, and optionally `ca-cert.pem`
    /// (then client certificates are required and verified against it).
    pub cert_dir: Option<PathBuf>,
    /// FORCEDTLS: every option but STARTTLS and ABORT is refused with `NBD_REP_ERR_TLS_REQD`
    /// until TLS is up. Otherwise TLS is the client's choice.
    pub required: bool,
    /// The tenant each client certificate acts for, by its common name (`[tls]
    /// certificate_tenants`). Required when `ca-cert.pem` makes the server verify client
    /// certificates: a certificate whose CN is not in it fails the handshake. Certificate
    /// names and PSK identities are two namespaces; only this map joins a CN to a tenant.
    pub certificate_tenants: Option<std::collections::BTreeMap<String, String>>,
    /// Also offer the TLS 1.2 suites without forward secrecy (plain PSK) and the CBC ones,
    /// for old clients (`[tls] legacy_cipher_suites`). Off: only ephemeral (EC)DHE with AEAD.
    pub legacy_cipher_suites: bool,
    /// TLS handshakes per second per client address group, bursts of twice that
    /// (`[tls] handshakes_per_s_per_address`, `handshake_limit.rs`); 0: no limit.
    pub handshakes_per_s_per_address: u32,
}

/// Everything `Node::start` needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub backend: StoreBackend,
    pub nbd_listen: SocketAddr,
    pub api_listen: SocketAddr,
    pub limits: Limits,
    /// Worker threads that execute block I/O; 0 runs everything but FLUSH inline on the
    /// session task.
    pub io_threads: usize,
    /// Requests moving at most this many payload bytes run inline on the session task even
    /// when there are workers (a thread hop costs more than a small memcpy); larger ones and
    /// FLUSH go to the workers. `None`: 64 KiB when every device keeps its data in RAM (the
    /// memory backend, or device files on tmpfs or ramfs), 0 otherwise (a cold disk read
    /// must not stall a network thread).
    pub inline_max_bytes: Option<u32>,
    /// How long a network thread about to sleep first waits for more requests, so it answers
    /// several per wake-up (`node::coalesce`); 0: never. `None`: `DEFAULT_COALESCE_US` for
    /// the memory and RADOS backends, 0 with device files (see `effective_coalesce_us`).
    pub coalesce_us: Option<u64>,
    /// Threads that own the NBD connections, each a single-threaded runtime a connection
    /// lives on from accept to close (`node::net_threads`); 0: connections share the
    /// process's multi-thread runtime instead. `None`: one per CPU (see
    /// `effective_net_threads`).
    pub net_threads: Option<usize>,
    /// How I/O is scheduled (policy, capacity, workers, dispatch).
    pub qos: QosConfig,
    /// An emulated device in front of the backend: a known bottleneck for experiments.
    pub emulated_device: Option<EmulatedDeviceSpec>,
    /// A non-linear cost curve for the emulated device in place of its linear model
    /// (`EmulatedDevice::start_with_curve`); ignored without `emulated_device`.
    pub emulated_curve: Option<headroom_qos::model::VopCurve>,
    /// Which copy of a replicated volume serves a read (`[storage] read_routing`; FAST's
    /// type-aware routing with stealing by default).
    pub read_routing: headroom_qos::routing::ReadRouting,
    /// How often credit balances are saved while running (they are always saved at a clean
    /// shutdown).
    pub credit_save_period_ms: u64,
    /// TLS on the NBD port; `None`: plaintext only (STARTTLS is answered `NBD_REP_ERR_UNSUP`).
    pub tls: Option<TlsConfig>,
    /// Which volumes get series of their own in `/metrics` (`[metrics]`).
    pub metrics: crate::metrics::MetricsConfig,
    /// The management API's bearer token; `None`: a random one (`RunningNode::api_token`).
    pub api_token: Option<crate::api::ApiToken>,
    /// The management API's connection cap and timeouts (`crate::api::conn`).
    pub api_limits: crate::api::conn::ApiLimits,
    /// Where the scoped API tokens are kept (hashed); `None`: in memory only, lost at exit.
    pub api_tokens_file: Option<PathBuf>,
    /// The management API's audit log (JSON lines); `None`: no audit log.
    pub audit_log: Option<PathBuf>,
    /// Most volume bytes per pool byte (`Store::set_overcommit_ratio`); `None`: no limit.
    pub overcommit_ratio: Option<f64>,
    /// What `POST /v1/devices` may take (allowed directories, named block devices) and the
    /// device and volume size caps (`Store::set_admission_policy`).
    pub device_admission: headroom_store::AdmissionPolicy,
    /// The rate the rebuild of lost copies starts at, bytes per second (`[storage.rebuild]
    /// rate`; `PUT /v1/rebuild` changes it live).
    pub rebuild_rate_bytes_per_s: u64,
    /// The rate the background scrub reads at, bytes per second (`[storage.scrub] rate`;
    /// `PUT /v1/scrub` changes it live).
    pub scrub_rate_bytes_per_s: u64,
    /// Seconds from the start of one scrub pass to the start of the next (`[storage.scrub]
    /// interval_s`); 0: only on demand (`POST /v1/scrub`).
    pub scrub_interval_s: u64,
    /// Read and write errors after which a device is failed for good, as `headroom device
    /// fail` would (`[storage.rebuild] fail_device_after_errors`; 0: never).
    pub fail_device_after_errors: u64,
    /// Where the settings came from, shown by `GET /v1/node` (informational).
    pub config_file: Option<PathBuf>,
    pub calibration_file: Option<PathBuf>,
    /// Cross-node arbitration of a shared RADOS backend (`node::arbitration`); needs the
    /// RADOS backend and a scheduling policy. `None`: the node's capacity is fixed.
    pub arbitration: Option<crate::arbitration::ArbitrationConfig>,
    /// Bytes preallocated in the data directory for metadata commits on a full disk
    /// (`headroom_store::StoreConfig::metadata_reserve_bytes`; file stores); 0: none.
    pub metadata_reserve_bytes: u64,
    /// Devices this node creates (at a new data directory's start) get per-block checksums
    /// (`[storage] checksums`, `headroom_store::StoreConfig::checksums`); file stores.
    pub checksums: bool,
}

/// `NodeConfig::coalesce_us` by default for the memory and RADOS backends: one or two request arrivals
/// at 150k requests/s. Of 10, 20, 30, 50 and 100 µs it gave the most IOPS at 4 KiB QD32 here,
/// at the same CPU per I/O as 20-30 µs; longer waits lose IOPS (docs/results.md, "Data path
/// speed").
pub const DEFAULT_COALESCE_US: u64 = 10;
/// Longest coalescing wait accepted: beyond it the wait is latency, not batching.
pub const MAX_COALESCE_US: u64 = 1000;

impl NodeConfig {
    /// The coalescing wait in force (see `coalesce_us`). Off by default on device files: on
    /// files (measured on tmpfs, where it could help most) the batches it made bought no CPU
    /// per I/O and cost 12-17 % of the IOPS, each request being a `pread` that holds the
    /// whole batch's replies back. On by default on RAM, where it saves 7-14 % of the CPU per
    /// I/O, and on RADOS, where replies come back from librados' completion thread and the
    /// wait lets one wake-up of the connection thread send several (1.04x the IOPS, 0.93-0.97x
    /// the server's CPU per 4 KiB I/O over seven rounds; docs/results.md, "Headroom on RADOS
    /// against RBD").
    pub fn effective_coalesce_us(&self) -> u64 {
        match (self.coalesce_us, &self.backend) {
            (Some(us), _) => us,
            (None, StoreBackend::Memory { .. } | StoreBackend::Rados { .. }) => DEFAULT_COALESCE_US,
            (None, StoreBackend::Files { .. }) => 0,
        }
    }

    /// The connection threads in force (see `net_threads`): one per CPU the process may run
    /// on by default, capped at `net_threads::MAX_NET_THREADS`.
    pub fn effective_net_threads(&self) -> usize {
        self.net_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
            .min(crate::net_threads::MAX_NET_THREADS)
    }

    /// The inline threshold in force (see `inline_max_bytes`), given whether every device
    /// of the opened store keeps its data in RAM (`Store::is_memory_resident`).
    pub fn effective_inline_max_bytes(&self, memory_resident: bool) -> u32 {
        match self.inline_max_bytes {
            Some(bytes) => bytes,
            None if memory_resident => 64 << 10,
            None => 0,
        }
    }

    pub fn default_nbd_listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 10809))
    }

    pub fn default_api_listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 10810))
    }

    pub fn new(backend: StoreBackend) -> Self {
        NodeConfig {
            backend,
            nbd_listen: Self::default_nbd_listen(),
            api_listen: Self::default_api_listen(),
            limits: Limits::default(),
            io_threads: 2,
            coalesce_us: None,
            net_threads: None,
            inline_max_bytes: None,
            qos: QosConfig::default(),
            emulated_device: None,
            emulated_curve: None,
            read_routing: headroom_qos::routing::ReadRouting::TypeAware,
            credit_save_period_ms: 1_000,
            tls: None,
            metrics: crate::metrics::MetricsConfig::default(),
            api_token: None,
            api_limits: crate::api::conn::ApiLimits::default(),
            api_tokens_file: None,
            audit_log: None,
            overcommit_ratio: None,
            device_admission: headroom_store::AdmissionPolicy::default(),
            rebuild_rate_bytes_per_s: crate::repair::DEFAULT_REBUILD_RATE_BYTES_PER_S,
            scrub_rate_bytes_per_s: crate::scrub::DEFAULT_SCRUB_RATE_BYTES_PER_S,
            scrub_interval_s: crate::scrub::DEFAULT_SCRUB_INTERVAL_S,
            fail_device_after_errors: crate::repair::DEFAULT_FAIL_DEVICE_AFTER_ERRORS,
            config_file: None,
            calibration_file: None,
            arbitration: None,
            metadata_reserve_bytes: headroom_store::DEFAULT_METADATA_RESERVE_BYTES,
            checksums: true,
        }
    }
}

/// Which scheduler runs the I/O, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyChoice {
    /// No scheduler: requests run in arrival order, unlimited (the path before QoS; kept for
    /// comparison).
    Off,
    /// One of the shipped policies.
    #[serde(untagged)]
    Policy(PolicyKind),
}

impl PolicyChoice {
    /// The policy, if any.
    pub fn kind(self) -> Option<PolicyKind> {
        match self {
            PolicyChoice::Off => None,
            PolicyChoice::Policy(kind) => Some(kind),
        }
    }
}

impl std::fmt::Display for PolicyChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyChoice::Off => f.write_str("off"),
            PolicyChoice::Policy(kind) => write!(f, "{kind}"),
        }
    }
}

impl std::str::FromStr for PolicyChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(PolicyChoice::Off);
        }
        s.parse::<PolicyKind>()
            .map(PolicyChoice::Policy)
            .map_err(|_| {
                format!("unknown policy {s:?}: expected off, wild, base, credit, burst, mclock or drr-vop")
            })
    }
}

/// How a request finds its scheduler worker (BurstCBS's mapping of queues to threads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DispatchMode {
    /// Requests are sprayed round robin over the workers, one by one; each worker enforces
    /// 1/N of every volume's QoS over 1/N of the node's capacity.
    #[default]
    OneToN,
    /// Every request of a volume goes to the volume's home worker, which enforces its whole
    /// QoS over 1/N of the node's capacity (a busy volume cannot use the other workers).
    OneToOne,
    /// A request goes to its volume's home worker unless that worker has a backlog and another
    /// has none: then it goes to the idle one. Each worker enforces 1/N of every volume's QoS.
    Stealing,
}

impl std::str::FromStr for DispatchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "one-to-n" | "1-to-n" | "1ton" => Ok(DispatchMode::OneToN),
            "one-to-one" | "1-to-1" | "1to1" => Ok(DispatchMode::OneToOne),
            "stealing" | "work-stealing" => Ok(DispatchMode::Stealing),
            _ => Err(format!(
                "unknown dispatch mode {s:?}: expected one-to-n, one-to-one or stealing"
            )),
        }
    }
}

/// The scheduler's configuration: which policy, over what capacity, with how many workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QosConfig {
    pub policy: PolicyChoice,
    /// Tunables of the policies (`track_invariants` is off on the server).
    pub params: PolicyParams,
    /// What the whole node can do per second; each worker gets `1/workers` of it.
    pub capacity: NodeCapacity,
    /// Estimates each request's cost vector (CPU, ingress, egress, device units).
    pub cost_model: CostModel,
    /// Scheduler workers (each runs its own policy instance).
    pub workers: usize,
    pub dispatch: DispatchMode,
    /// Requests that may be in flight at the device (dispatched, not completed) before a
    /// request above its baseline waits for a completion (`node::scheduler`, "burst gate").
    /// `None`: the emulated device's parallelism minus one (one channel kept free for
    /// baseline requests), no gate without an emulated device; `Some(0)`: no gate.
    pub burst_in_flight: Option<u32>,
    /// Moves capacity between workers every policy window by what they used
    /// (`node::global_pool`); `false`: each worker keeps `1/workers` of the node.
    pub global_pool: bool,
}

impl Default for QosConfig {
    /// `burst` over [`QosConfig::default_capacity`] with two workers sprayed 1-to-N.
    fn default() -> Self {
        let workers = 2;
        QosConfig {
            policy: PolicyChoice::Policy(PolicyKind::Burst),
            params: QosConfig::server_params(),
            capacity: QosConfig::default_capacity(workers),
            cost_model: CostModel::new(
                headroom_qos::model::CpuModel::default(),
                headroom_qos::model::DeviceModel::None,
            ),
            workers,
            dispatch: DispatchMode::OneToN,
            burst_in_flight: None,
            global_pool: true,
        }
    }
}

impl QosConfig {
    /// The policy parameters a server runs with: the library's defaults, without invariant
    /// tracking (verification, not scheduling), and with a 1 ms node pacer depth so that a
    /// wake-up that comes tens of µs late does not lose capacity
    /// (`PolicyParams::pacer_depth_ns`).
    pub fn server_params() -> PolicyParams {
        PolicyParams {
            track_invariants: false,
            pacer_depth_ns: 1_000_000,
            ..PolicyParams::default()
        }
    }

    /// A capacity that is safe on any machine: one CPU-second per second per worker (a worker
    /// cannot do more than that), no network or device limit (neither is known before
    /// `headroom calibrate` has measured them). With it the scheduler enforces every volume's
    /// baseline and ceiling and never holds the node below what its CPUs can do.
    pub fn default_capacity(workers: usize) -> NodeCapacity {
        let workers = u64::try_from(workers.max(1)).unwrap_or(u64::MAX);
        NodeCapacity::new(CostVector::new(
            NS_PER_S.saturating_mul(workers),
            u64::MAX,
            u64::MAX,
            u64::MAX,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalescing_is_on_by_default_except_on_device_files() {
        let rados = NodeConfig::new(StoreBackend::Rados {
            data_dir: PathBuf::from("d"),
            conf: PathBuf::from("ceph.conf"),
            id: "admin".to_owned(),
            pool: "p".to_owned(),
            capacity_bytes: 1 << 30,
            namespace: None,
            lease_ms: 3000,
            lease_wait_ms: None,
            lease_lost_linger_ms: 0,
        });
        assert_eq!(rados.effective_coalesce_us(), DEFAULT_COALESCE_US);
        let memory = NodeConfig::new(StoreBackend::Memory {
            capacity_bytes: 1 << 30,
        });
        assert_eq!(memory.effective_coalesce_us(), DEFAULT_COALESCE_US);
        let mut files = NodeConfig::new(StoreBackend::Files {
            data_dir: PathBuf::from("d"),
            device_count: 1,
            device_capacity_bytes: 1 << 30,
            device_paths: Vec::new(),
        });
        assert_eq!(files.effective_coalesce_us(), 0);
        files.coalesce_us = Some(7);
        assert_eq!(files.effective_coalesce_us(), 7);
    }

    fn broken(change: impl FnOnce(&mut Limits)) -> LimitsError {
        let mut limits = Limits::default();
        change(&mut limits);
        match limits.validate() {
            Ok(()) => panic!("accepted: {limits:?}"),
            Err(err) => err,
        }
    }

    #[test]
    fn each_connection_reserves_a_quarter_of_the_node_budget_split_between_connections() {
        let reserved = |change: fn(&mut Limits)| {
            let mut limits = Limits::default();
            change(&mut limits);
            limits.reserved_inflight_bytes_per_conn()
        };
        // 1 GiB / 4 / 256 connections.
        assert_eq!(reserved(|_| {}), 1 << 20);
        // Rounded down to a power of two: 1 GiB / 4 / 300 is 873 KiB.
        assert_eq!(reserved(|l| l.max_connections = 300), 512 << 10);
        // At most the largest request's buffer, with few connections.
        assert_eq!(reserved(|l| l.max_connections = 1), 32 << 20);
        assert_eq!(reserved(|l| l.max_request_bytes = 100_000), 128 << 10);
        // The shared pool always keeps room for the largest request: a node budget of one
        // request reserves nothing, and so does a share below the smallest buffer.
        assert_eq!(reserved(|l| l.max_inflight_bytes_per_node = 32 << 20), 0);
        assert_eq!(reserved(|l| l.max_connections = 1 << 20), 0);
        for connections in [1, 3, 256, 4096] {
            for node_mib in [32u64, 33, 64, 1024] {
                let mut limits = Limits {
                    max_connections: connections,
                    max_inflight_bytes_per_node: node_mib << 20,
                    ..Limits::default()
                };
                limits.max_inflight_bytes_per_conn =
                    limits.max_inflight_bytes_per_node.min(128 << 20);
                let reserve =
                    limits.reserved_inflight_bytes_per_conn() * u64::try_from(connections).unwrap();
                assert!(reserve <= limits.max_inflight_bytes_per_node / 4);
                assert!(limits.max_inflight_bytes_per_node - reserve >= 32 << 20);
            }
        }
    }

    #[test]
    fn each_byte_level_holds_the_largest_request_and_fits_in_the_next() {
        assert_eq!(Limits::default().validate(), Ok(()));
        // A 20 MiB request occupies a 32 MiB buffer: 24 MiB per connection could never hold it.
        let err = broken(|l| {
            l.max_request_bytes = 20 << 20;
            l.max_inflight_bytes_per_conn = 24 << 20;
        });
        assert_eq!(err.key, "max_inflight_bytes");
        assert_eq!(
            err.rule,
            LimitRule::HoldsLargestRequest {
                request_bytes: 20 << 20,
                charge_bytes: 32 << 20
            }
        );
        let err = broken(|l| l.max_inflight_bytes_per_tenant = 64 << 20);
        assert_eq!(
            err.to_string(),
            "limits.max_inflight_bytes = 134217728: must be at most \
             limits.max_inflight_bytes_per_tenant (67108864 bytes)"
        );
        let err = broken(|l| l.max_inflight_bytes_per_node = 128 << 20);
        assert_eq!(err.key, "max_inflight_bytes_per_tenant");
        // Too small for a request is said before "larger than the next level".
        let err = broken(|l| l.max_inflight_bytes_per_node = 16 << 20);
        assert_eq!(err.key, "max_inflight_bytes_per_node");
        assert!(matches!(err.rule, LimitRule::HoldsLargestRequest { .. }));
        // Equal levels are fine.
        let mut limits = Limits::default();
        limits.max_inflight_bytes_per_tenant = limits.max_inflight_bytes_per_conn;
        limits.max_inflight_bytes_per_node = limits.max_inflight_bytes_per_conn;
        assert_eq!(limits.validate(), Ok(()));
    }

    #[test]
    fn counts_and_timeouts_are_bounded() {
        assert_eq!(broken(|l| l.max_connections = 0).key, "max_connections");
        let err = broken(|l| l.max_connections_per_ip = 257);
        assert_eq!(
            err.to_string(),
            "limits.max_connections_per_ip = 257: must be between 1 and limits.max_connections (256)"
        );
        assert_eq!(
            broken(|l| l.max_inflight_requests_per_conn = 65_537).key,
            "max_inflight_requests"
        );
        assert_eq!(broken(|l| l.max_request_bytes = 0).key, "max_request_bytes");
        assert_eq!(
            broken(|l| l.max_request_bytes = (32 << 20) + 1).key,
            "max_request_bytes"
        );
        assert_eq!(
            broken(|l| l.handshake_timeout_ms = u64::MAX).key,
            "handshake_timeout_ms"
        );
        assert_eq!(
            broken(|l| l.client_stall_timeout_ms = 0).key,
            "client_stall_timeout_ms"
        );
        // The per-connection semaphore counts in u32.
        let err = broken(|l| {
            l.max_inflight_bytes_per_conn = 4 << 30;
            l.max_inflight_bytes_per_tenant = 4 << 30;
            l.max_inflight_bytes_per_node = 4 << 30;
        });
        assert_eq!(err.key, "max_inflight_bytes");
    }
}
