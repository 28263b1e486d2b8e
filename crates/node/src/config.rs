//! Node configuration: where data lives, where we listen, and the limits that bound what one
//! client can make us hold. Defaults are the ones the CLI contract promises.

use std::net::SocketAddr;
use std::path::PathBuf;

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
}

/// Bounds on what clients can make the server hold.
#[derive(Clone, Debug)]
pub struct Limits {
    /// NBD connections served at once; one more is closed right after accept.
    pub max_connections: usize,
    /// Requests read from one connection but not yet answered.
    pub max_inflight_requests_per_conn: usize,
    /// Payload bytes (write data read, read data not yet sent) held per connection.
    pub max_inflight_bytes_per_conn: u64,
    /// Largest READ/WRITE payload, advertised as the maximum block size.
    pub max_request_bytes: u32,
    /// Time a client has to finish option negotiation.
    pub handshake_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            max_inflight_requests_per_conn: 256,
            max_inflight_bytes_per_conn: 128 << 20,
            max_request_bytes: 32 << 20,
            handshake_timeout_ms: 30_000,
        }
    }
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
    /// FLUSH go to the workers. `None`: 64 KiB for the memory backend, 0 for files (a cold
    /// disk read must not stall a network thread).
    pub inline_max_bytes: Option<u32>,
}

impl NodeConfig {
    /// The inline threshold in force (see `inline_max_bytes`).
    pub fn effective_inline_max_bytes(&self) -> u32 {
        match (self.inline_max_bytes, &self.backend) {
            (Some(bytes), _) => bytes,
            (None, StoreBackend::Memory { .. }) => 64 << 10,
            (None, StoreBackend::Files { .. }) => 0,
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
            inline_max_bytes: None,
        }
    }
}
