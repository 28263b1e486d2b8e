//! `[limits]`: what clients can make the server hold (connections, requests and bytes in
//! flight, timeouts), declared once here: file name, flag, help, check, and the node's
//! [`Limits`] they become, which `Limits::validate` checks as a whole.

use clap::Args;
use headroom_node::Limits;
use headroom_node::config::{LimitRule, LimitsError};
use merge::Merge;
use serde::Deserialize;

use super::{Invalid, Size};
use crate::size::format_size;

/// Smallest request-size limit: the block size we advertise as preferred.
const MIN_REQUEST_BYTES: u64 = headroom_nbd::PREFERRED_BLOCK_BYTES as u64;
/// Largest request-size limit the NBD layer accepts.
const MAX_REQUEST_BYTES: u64 = headroom_nbd::MAX_PAYLOAD_BYTES as u64;

/// `[limits]`: what clients can make the server hold ([`Limits`]).
#[derive(Args, Clone, Debug, Default, PartialEq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct LimitsSection {
    /// Maximum NBD connections at once [default: 256].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Absent: `max_connections` (no cap per address).
    #[arg(skip)]
    pub max_connections_per_ip: Option<usize>,
    /// IPv6 clients sharing this prefix are one address for `max_connections_per_ip`.
    #[arg(skip)]
    pub ipv6_prefix_len: Option<u8>,
    /// Maximum requests in flight per connection [default: 256].
    #[arg(long, value_name = "N")]
    pub max_inflight_requests: Option<usize>,
    /// Per connection.
    #[arg(skip)]
    pub max_inflight_bytes: Option<Size>,
    #[arg(skip)]
    pub max_inflight_bytes_per_tenant: Option<Size>,
    #[arg(skip)]
    pub max_inflight_bytes_per_node: Option<Size>,
    #[arg(skip)]
    pub max_request_bytes: Option<Size>,
    #[arg(skip)]
    pub handshake_timeout_ms: Option<u64>,
    #[arg(skip)]
    pub client_stall_timeout_ms: Option<u64>,
}

impl LimitsSection {
    /// Checks every value that can be checked on its own.
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let li = self;
        if let Some(0) = li.max_connections {
            return Err(Invalid::new(
                "limits.max_connections",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.max_inflight_requests {
            return Err(Invalid::new(
                "limits.max_inflight_requests",
                0,
                "must be at least 1",
            ));
        }
        if let Some(size) = li.max_request_bytes
            && !(MIN_REQUEST_BYTES..=MAX_REQUEST_BYTES).contains(&size.0)
        {
            return Err(Invalid::new(
                "limits.max_request_bytes",
                size,
                format!(
                    "must be between {} and {} (the NBD layer's limit)",
                    format_size(MIN_REQUEST_BYTES),
                    format_size(MAX_REQUEST_BYTES)
                ),
            ));
        }
        if let Some(size) = li.max_inflight_bytes
            && (size.0 == 0 || u32::try_from(size.0).is_err())
        {
            return Err(Invalid::new(
                "limits.max_inflight_bytes",
                size,
                "must be greater than 0 and less than 4GiB",
            ));
        }
        if let Some(0) = li.handshake_timeout_ms {
            return Err(Invalid::new(
                "limits.handshake_timeout_ms",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.max_connections_per_ip {
            return Err(Invalid::new(
                "limits.max_connections_per_ip",
                0,
                "must be at least 1",
            ));
        }
        if let Some(0) = li.client_stall_timeout_ms {
            return Err(Invalid::new(
                "limits.client_stall_timeout_ms",
                0,
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// The table over [`Limits::default`], checked as a whole ([`Limits::validate`]:
    /// the largest request fits in the per-connection bytes, which fit in the per-tenant bytes,
    /// which fit in the node's; the per-address cap in the connection cap).
    pub(super) fn limits(&self) -> Result<Limits, Invalid> {
        let li = self;
        let d = Limits::default();
        let max_connections = li.max_connections.unwrap_or(d.max_connections);
        let limits = Limits {
            max_connections,
            max_connections_per_ip: li.max_connections_per_ip.unwrap_or(max_connections),
            ipv6_prefix_len: li.ipv6_prefix_len.unwrap_or(d.ipv6_prefix_len),
            max_inflight_requests_per_conn: li
                .max_inflight_requests
                .unwrap_or(d.max_inflight_requests_per_conn),
            max_inflight_bytes_per_conn: li
                .max_inflight_bytes
                .map_or(d.max_inflight_bytes_per_conn, |s| s.0),
            max_inflight_bytes_per_tenant: li
                .max_inflight_bytes_per_tenant
                .map_or(d.max_inflight_bytes_per_tenant, |s| s.0),
            max_inflight_bytes_per_node: li
                .max_inflight_bytes_per_node
                .map_or(d.max_inflight_bytes_per_node, |s| s.0),
            max_request_bytes: li.max_request_bytes.map_or(d.max_request_bytes, |s| {
                u32::try_from(s.0).unwrap_or(u32::MAX)
            }),
            handshake_timeout_ms: li.handshake_timeout_ms.unwrap_or(d.handshake_timeout_ms),
            client_stall_timeout_ms: li
                .client_stall_timeout_ms
                .unwrap_or(d.client_stall_timeout_ms),
        };
        limits.validate().map_err(limits_invalid)?;
        Ok(limits)
    }
}

/// A node limits error in this file's words: sizes with units.
fn limits_invalid(err: LimitsError) -> Invalid {
    let key = format!("limits.{}", err.key);
    let is_size = matches!(
        err.key,
        "max_inflight_bytes"
            | "max_inflight_bytes_per_tenant"
            | "max_inflight_bytes_per_node"
            | "max_request_bytes"
    );
    let value = if is_size {
        Size(err.value).to_string()
    } else {
        err.value.to_string()
    };
    let allowed = match err.rule {
        LimitRule::Between { min, max } if is_size => format!(
            "must be between {} and {}",
            format_size(min),
            format_size(max)
        ),
        LimitRule::HoldsLargestRequest {
            request_bytes,
            charge_bytes,
        } => format!(
            "must be at least {}, the buffer a request of limits.max_request_bytes ({}) \
             occupies, or such a request would wait forever",
            format_size(charge_bytes),
            format_size(request_bytes)
        ),
        LimitRule::AtMostOuterBytes { outer, outer_bytes } => format!(
            "must be at most limits.{outer} ({})",
            format_size(outer_bytes)
        ),
        other => other.to_string(),
    };
    Invalid::new(key, value, allowed)
}
