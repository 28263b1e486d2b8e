//! The management-API calls a lab run makes on a Headroom server, as traits its caller
//! implements: create and delete volumes, read `GET /v1/node` and `GET /metrics`, make a token
//! for a server the lab starts.
//!
//! Why traits rather than an HTTP client here: the `headroom` binary already has the API
//! client, with its bearer-token handling and its typed errors (which it turns into the CLI's
//! exit codes). A lab run goes through that client, so an API failure during `lab run` reads
//! and exits as it does for every other command, and this crate needs no HTTP client or API
//! types of its own. Failures come back boxed ([`ApiFailure`]) and stay the chain's source, so
//! the caller can still find its own error type in them.

use headroom_qos::QosSpec;

/// A failed API call, as the implementation reports it (kept as the source of a
/// [`RunError`](crate::RunError), so a caller can downcast it back).
pub type ApiFailure = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What `GET /v1/node` says that a run needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The NBD address (`nbd_listen`), if the answer had one.
    pub nbd_listen: Option<String>,
    /// The policy the server runs (`policy`), if the answer had one.
    pub policy: Option<String>,
}

/// One Headroom server's management API.
pub trait ServerApi {
    /// `POST /v1/volumes`: a volume of `size_bytes` with `qos` (empty: unlimited).
    fn create_volume(&self, name: &str, size_bytes: u64, qos: &QosSpec) -> Result<(), ApiFailure>;
    /// `DELETE /v1/volumes/{name}`.
    fn delete_volume(&self, name: &str) -> Result<(), ApiFailure>;
    /// `GET /v1/node`.
    fn node(&self) -> Result<NodeInfo, ApiFailure>;
    /// `GET /metrics`, the Prometheus text.
    fn metrics(&self) -> Result<String, ApiFailure>;
}

/// Reaching the servers of a run.
pub trait Connector {
    /// A fresh random token for a server the lab starts (loopback only, for the run; it keeps
    /// the API's authentication on, as in production).
    fn new_token(&self) -> Result<String, ApiFailure>;
    /// A client of the API at `url` with `token`.
    fn connect(&self, url: &str, token: &str) -> Result<Box<dyn ServerApi>, ApiFailure>;
}
