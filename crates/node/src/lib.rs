//! The Headroom node: the async shell around the pure pieces.
//!
//! `headroom-nbd` knows the wire format, `headroom-store` knows where bytes live, and this crate
//! joins them to sockets: an NBD listener with one session per connection, an executor that runs
//! block I/O off the async runtime when it may block, and the HTTP/JSON management API. Every
//! queue here is bounded: connections (in all and per address; negotiating ones make room for
//! new ones), requests in flight per connection, and payload bytes in flight per connection,
//! per tenant and per node. A misbehaving client costs the others at most its tenant's budget.

pub mod address_group;
pub mod admission;
pub mod api;
pub mod arbitration;
pub mod budget;
pub mod buffers;
pub mod clock;
pub mod coalesce;
pub mod config;
pub mod emulated;
pub mod exec;
pub mod handshake_limit;
pub mod limits;
pub mod memory_transport;
pub mod metrics;
pub mod net_threads;
pub mod origin;
pub mod paced;
pub mod pipeline;
pub mod readiness;
pub mod repair;
pub mod scheduler;
pub mod scrub;
pub mod server;
pub mod session;
pub mod setting;
pub mod slots;
mod sync;
pub mod timeline;
#[cfg(feature = "tls")]
pub mod tls;
pub mod tls_config;
pub mod vhost_user;
pub mod volume_qos;

pub use config::{Limits, NodeConfig, StoreBackend, TlsConfig, UnixSocketConfig};

/// Whether this build can serve TLS (the `tls` cargo feature).
pub const TLS_SUPPORTED: bool = cfg!(feature = "tls");
pub use server::{Node, NodeError, RunningNode};
