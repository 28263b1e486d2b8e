//! What can go wrong in a lab run beyond the load itself: the scenario, the servers and
//! peers the lab starts, their APIs, the files it writes.
//!
//! Why a type of its own next to [`LabError`]: `LabError` is the load generator's (a
//! connection, a reply, a load spec) and is kept as it is, one variant here; the orchestration
//! adds processes, ports, logs and API calls, which the generator never sees. Every variant's
//! message is one step of the story ("creating volume lab-a-0"), the cause its `source`, so
//! the caller prints the chain.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use crate::LabError;
use crate::api::ApiFailure;
use crate::plan::PlanError;

/// A lab run's failure.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The scenario file could not be read or parsed.
    #[error("loading scenario {}", file.display())]
    LoadScenario {
        file: PathBuf,
        #[source]
        source: headroom_sim::SimError,
    },
    /// The scenario asks for something the lab cannot do.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A `--policy` value that is neither the server's nor a peer's.
    #[error(
        "--policy {policy}: neither a policy of the live server (off, wild, base, credit, burst, mclock, drr-vop; fifo = off) nor a peer ({peers})"
    )]
    UnknownPolicy { policy: String, peers: String },
    /// Peers asked for in a run against a running server.
    #[error("--target runs against one server: peers cannot be combined with it")]
    TargetWithPeers,
    /// A run against a running server without its token.
    #[error("--target needs the server's API token (--token or HEADROOM_TOKEN)")]
    TargetToken,
    /// `GET /v1/node` of the target named no NBD address.
    #[error("GET /v1/node: no nbd_listen")]
    TargetNoNbd,
    /// The policies asked for are not the one the target runs.
    #[error(
        "--target {url} runs policy {policy}; --policy {requested} cannot be honoured against it (start that server with --policy, or leave --policy out)"
    )]
    TargetPolicy {
        url: String,
        policy: String,
        /// The `--policy` values, joined by `, --policy `.
        requested: String,
    },
    /// A name that is not a peer.
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    /// The load generator failed.
    #[error(transparent)]
    Load(#[from] LabError),
    /// A file, directory, socket or process operation failed.
    #[error("{context}")]
    Io {
        /// What the lab was doing (`creating /tmp/...`).
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// An API call failed; `what` says which.
    #[error("{what}")]
    ApiCall {
        what: String,
        #[source]
        source: ApiFailure,
    },
    /// An API call failed, its own message saying which (the chain shows it once).
    #[error("{0}")]
    Api(#[source] ApiFailure),
    /// `headroom serve` did not print its addresses in time.
    #[error("headroom serve (policy {policy}) did not become ready ({status}); its log:\n{log}")]
    NotReady {
        policy: String,
        /// Its exit status, or `still running`.
        status: String,
        log: String,
    },
    /// `headroom serve`'s output was not what the lab reads.
    #[error("{0}")]
    ReadyLine(&'static str),
    /// A peer exited before it listened.
    #[error("{name} exited with {status}; its log:\n{log}")]
    PeerExited {
        name: String,
        status: ExitStatus,
        log: String,
    },
    /// A peer did not listen in time.
    #[error("{name} did not listen on port {port} within {timeout:?}; its log:\n{log}")]
    PeerNotListening {
        name: String,
        port: u16,
        timeout: Duration,
        log: String,
    },
    /// A failure while a server ran, with the end of its log.
    #[error("{name} log (last lines):\n{log}")]
    WithLog {
        /// `server`, or the peer's name.
        name: String,
        log: String,
        #[source]
        source: Box<RunError>,
    },
}

impl RunError {
    /// An I/O error's wrapper, for `map_err`.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RunError {
        let context = context.into();
        move |source| RunError::Io { context, source }
    }
}
