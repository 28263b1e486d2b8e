//! Node configuration: where data lives, where we listen, and everything `Node::start` needs.
//! Defaults are the ones the CLI contract promises. The settings of the parts below the node
//! live with those parts (`limits`, `scheduler::config`, `tls`) and are re-exported here, so
//! the request path does not depend on this module.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::emulated::EmulatedDeviceSpec;
pub use crate::limits::*;
pub use crate::scheduler::config::{DispatchMode, PolicyChoice, QosConfig};
pub use crate::setting::{InvalidSetting, MAX_COALESCE_US};
pub use crate::tls_config::TlsConfig;

/// A configuration `Node::start` refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Limits(#[from] LimitsError),
    #[error(transparent)]
    Setting(#[from] InvalidSetting),
    #[error(transparent)]
    Admission(#[from] headroom_store::InvalidPolicy),
}

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

impl StoreBackend {
    /// The rule of each of the backend's values (`setting`): sizes and counts at least 1,
    /// RADOS names and times within range.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        use crate::setting::*;
        match self {
            StoreBackend::Memory { capacity_bytes } => check_memory_bytes(*capacity_bytes),
            StoreBackend::Files {
                device_count,
                device_capacity_bytes,
                device_paths,
                ..
            } => {
                // Named devices replace the created files, so their count does not matter.
                if device_paths.is_empty() {
                    check_device_count(*device_count)?;
                }
                check_device_size(*device_capacity_bytes)
            }
            StoreBackend::Rados {
                id,
                pool,
                capacity_bytes,
                namespace,
                lease_ms,
                lease_lost_linger_ms,
                ..
            } => {
                check_rados_pool(pool)?;
                check_rados_id(id)?;
                if let Some(ns) = namespace {
                    check_rados_namespace(ns)?;
                }
                check_device_size(*capacity_bytes)?;
                check_rados_lease_ms(*lease_ms)?;
                check_rados_lease_lost_linger_ms(*lease_lost_linger_ms)
            }
        }
    }
}

/// Everything `Node::start` needs.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub backend: StoreBackend,
    /// The NBD TCP listener; `None`: none (`[server] nbd_listen = "off"`), which needs
    /// `nbd_unix`.
    pub nbd_listen: Option<SocketAddr>,
    /// The NBD Unix socket (`[server] nbd_unix`), beside TCP or instead of it.
    pub nbd_unix: Option<UnixSocketConfig>,
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
    /// Threads that own the NBD connections and the vhost-user-blk queues, each a
    /// single-threaded runtime a connection (or queue) lives on from start to end
    /// (`node::net_threads`); 0: they share the process's multi-thread runtime instead.
    /// `None`: one per CPU (see `effective_net_threads`).
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

/// The NBD Unix socket: where, who may connect (the file's mode and owner) and the tenant
/// each local uid acts for (`node::server::unix_socket`; docs/operations.md, "NBD over a Unix
/// socket").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnixSocketConfig {
    pub path: PathBuf,
    /// The socket file's permission bits (at most `0o777`); `None`: what the umask leaves.
    pub mode: Option<u32>,
    /// The socket file's owner and group; `None`: the server's.
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The tenant a client whose uid (`SO_PEERCRED`) is a key acts for; any other uid is
    /// anonymous, as a TCP client without TLS.
    pub tenants: BTreeMap<u32, String>,
}

/// Longest socket path: `sun_path` holds 108 bytes on Linux, the last one a NUL.
pub const MAX_UNIX_SOCKET_PATH_BYTES: usize = 107;

impl UnixSocketConfig {
    /// The rules of its values: a path that fits `sun_path` and names a file, permission bits
    /// only, valid tenant ids.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        use std::os::unix::ffi::OsStrExt;
        let shown = self.path.display();
        let bytes = self.path.as_os_str().as_bytes().len();
        if bytes == 0 || bytes > MAX_UNIX_SOCKET_PATH_BYTES || self.path.file_name().is_none() {
            return Err(InvalidSetting::new(
                "server.nbd_unix",
                format!("{shown:?}"),
                format!(
                    "a file path of 1 to {MAX_UNIX_SOCKET_PATH_BYTES} bytes (the kernel's \
                     sun_path limit)"
                ),
            ));
        }
        if let Some(mode) = self.mode
            && mode > 0o777
        {
            return Err(InvalidSetting::new(
                "server.nbd_unix_mode",
                format!("{mode:o}"),
                "permission bits only, 0 to 0777 (setuid, setgid and sticky mean nothing on a socket)",
            ));
        }
        for (uid, tenant) in &self.tenants {
            headroom_store::validate_tenant_id(tenant).map_err(|e| {
                InvalidSetting::new(
                    "server.nbd_unix_tenants",
                    format!("{uid} = {tenant:?}"),
                    format!("a tenant id ({e})"),
                )
            })?;
        }
        Ok(())
    }
}

/// `NodeConfig::coalesce_us` by default for the memory and RADOS backends: one or two request arrivals
/// at 150k requests/s. Of 10, 20, 30, 50 and 100 µs it gave the most IOPS at 4 KiB QD32 here,
/// at the same CPU per I/O as 20-30 µs; longer waits lose IOPS (docs/results.md, "Data path
/// speed").
pub const DEFAULT_COALESCE_US: u64 = 10;

impl NodeConfig {
    /// Runs the rule of every node-owned setting (`setting`, `Limits::validate`,
    /// `QosConfig::validate`, `ApiLimits::validate`, `MetricsConfig::validate`, `StoreBackend::validate`;
    /// the store's `AdmissionPolicy::validate`): `Node::start` calls it, so a configuration built anywhere is
    /// checked before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.backend.validate()?;
        if self.nbd_listen.is_none() && self.nbd_unix.is_none() {
            return Err(InvalidSetting::new(
                "server.nbd_listen",
                "\"off\"",
                "needs server.nbd_unix: without either, no client could reach a volume",
            )
            .into());
        }
        if let Some(unix) = &self.nbd_unix {
            unix.validate()?;
        }
        self.device_admission.validate()?;
        self.limits.validate()?;
        crate::setting::check_io_threads(self.io_threads)?;
        if let Some(us) = self.coalesce_us {
            crate::setting::check_coalesce_us(us)?;
        }
        if let Some(n) = self.net_threads {
            crate::setting::check_net_threads(n)?;
        }
        self.qos.validate()?;
        self.api_limits.validate()?;
        self.metrics.validate()?;
        crate::setting::check_scrub_rate_bytes_per_s(self.scrub_rate_bytes_per_s)?;
        crate::setting::check_scrub_interval_s(self.scrub_interval_s)?;
        crate::setting::check_credit_save_period_ms(self.credit_save_period_ms)?;
        crate::setting::check_metadata_reserve_bytes(self.metadata_reserve_bytes)?;
        Ok(())
    }

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

    pub fn default_nbd_listen() -> Option<SocketAddr> {
        Some(Self::default_nbd_tcp())
    }

    /// The NBD TCP address by default.
    pub fn default_nbd_tcp() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 10809))
    }

    pub fn default_api_listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 10810))
    }

    pub fn new(backend: StoreBackend) -> Self {
        NodeConfig {
            backend,
            nbd_listen: Self::default_nbd_listen(),
            nbd_unix: None,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

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

    #[test]
    fn a_configuration_built_in_code_is_checked_as_a_file_would_be() {
        let good = NodeConfig::new(StoreBackend::Memory {
            capacity_bytes: 1 << 30,
        });
        assert_eq!(good.validate(), Ok(()));
        let key_of = |change: fn(&mut NodeConfig)| {
            let mut config = good.clone();
            change(&mut config);
            match config.validate() {
                Err(ConfigError::Setting(e)) => e.key,
                Err(ConfigError::Limits(e)) => e.key,
                Err(ConfigError::Admission(e)) => e.key,
                Ok(()) => "accepted",
            }
        };
        assert_eq!(key_of(|c| c.io_threads = 257), "server.io_threads");
        assert_eq!(key_of(|c| c.coalesce_us = Some(1001)), "server.coalesce_us");
        assert_eq!(key_of(|c| c.net_threads = Some(257)), "server.net_threads");
        assert_eq!(key_of(|c| c.qos.workers = 0), "qos.workers");
        assert_eq!(key_of(|c| c.qos.workers = 65), "qos.workers");
        assert_eq!(
            key_of(|c| c.qos.burst_in_flight = Some(65_537)),
            "qos.burst_in_flight"
        );
        assert_eq!(key_of(|c| c.limits.max_connections = 0), "max_connections");
        assert_eq!(
            key_of(|c| c.api_limits.max_connections = 0),
            "api.max_connections"
        );
        assert_eq!(
            key_of(|c| c.api_limits.idle_timeout_ms = 0),
            "api.idle_timeout_ms"
        );
        assert_eq!(
            key_of(|c| c.metrics.max_volume_series = 100_001),
            "metrics.max_volume_series"
        );
        assert_eq!(
            key_of(|c| c.metrics.volume_series_idle_s = u64::MAX),
            "metrics.volume_series_idle_s"
        );
        assert_eq!(
            key_of(|c| c.scrub_rate_bytes_per_s = 0),
            "storage.scrub.rate"
        );
        assert_eq!(
            key_of(|c| c.scrub_interval_s = 366 * 24 * 3600),
            "storage.scrub.interval_s"
        );
        assert_eq!(
            key_of(|c| c.credit_save_period_ms = 0),
            "qos.credit_save_period_ms"
        );
        assert_eq!(
            key_of(|c| c.metadata_reserve_bytes = (64 << 30) + 1),
            "storage.metadata_reserve"
        );
        assert_eq!(
            key_of(|c| c.backend = StoreBackend::Memory { capacity_bytes: 0 }),
            "storage.memory"
        );
        assert_eq!(
            key_of(|c| c.device_admission.max_device_bytes = 1),
            "storage.max_device_bytes"
        );
        assert_eq!(
            key_of(|c| c.device_admission.device_dirs = vec![PathBuf::from("relative")]),
            "storage.device_dirs"
        );
        let files = |count: u32, paths: Vec<PathBuf>| StoreBackend::Files {
            data_dir: PathBuf::from("d"),
            device_count: count,
            device_capacity_bytes: 1 << 30,
            device_paths: paths,
        };
        let rados = |pool: &str, lease_ms: u64| StoreBackend::Rados {
            data_dir: PathBuf::from("d"),
            conf: PathBuf::from("ceph.conf"),
            id: "headroom".to_string(),
            pool: pool.to_string(),
            capacity_bytes: 1 << 30,
            namespace: None,
            lease_ms,
            lease_wait_ms: None,
            lease_lost_linger_ms: 0,
        };
        let backend_key = |backend: StoreBackend| match backend.validate() {
            Err(e) => e.key,
            Ok(()) => "accepted",
        };
        assert_eq!(backend_key(files(0, Vec::new())), "storage.devices");
        assert_eq!(
            backend_key(files(0, vec![PathBuf::from("/dev/x")])),
            "accepted"
        );
        assert_eq!(backend_key(rados("a/b", 30_000)), "storage.rados_pool");
        assert_eq!(backend_key(rados("pool", 99)), "storage.rados_lease_ms");
        assert_eq!(backend_key(rados("pool", 100)), "accepted");
        // The edges of each range are allowed.
        assert_eq!(key_of(|c| c.scrub_interval_s = 0), "accepted");
        assert_eq!(key_of(|c| c.metadata_reserve_bytes = 64 << 30), "accepted");
        assert_eq!(key_of(|c| c.io_threads = 256), "accepted");
        assert_eq!(key_of(|c| c.qos.workers = 64), "accepted");
        // The Unix socket: a door is needed, and its values are checked.
        assert_eq!(key_of(|c| c.nbd_listen = None), "server.nbd_listen");
        fn unix(c: &mut NodeConfig) {
            c.nbd_listen = None;
            c.nbd_unix = Some(UnixSocketConfig {
                path: PathBuf::from("/run/headroom/nbd.sock"),
                mode: Some(0o660),
                ..UnixSocketConfig::default()
            });
        }
        assert_eq!(key_of(unix), "accepted");
        assert_eq!(
            key_of(|c| {
                unix(c);
                c.nbd_unix.as_mut().unwrap().mode = Some(0o4660);
            }),
            "server.nbd_unix_mode"
        );
        assert_eq!(
            key_of(|c| {
                unix(c);
                c.nbd_unix.as_mut().unwrap().path = PathBuf::from(format!("/{}", "x".repeat(107)));
            }),
            "server.nbd_unix"
        );
        assert_eq!(
            key_of(|c| {
                unix(c);
                c.nbd_unix
                    .as_mut()
                    .unwrap()
                    .tenants
                    .insert(1000, " alice".into());
            }),
            "server.nbd_unix_tenants"
        );
        assert_eq!(key_of(|c| c.coalesce_us = Some(1000)), "accepted");
    }
}
