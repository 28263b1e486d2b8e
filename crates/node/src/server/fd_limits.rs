//! The limits in force, logged at start, and the file descriptors they need: the soft
//! RLIMIT_NOFILE is raised, and the API's connection cap is fitted under it so that API
//! connections never take the descriptors NBD and the store need.

use crate::config::Limits;

/// File descriptors the node keeps for itself besides one per NBD and API connection: device
/// files, metadata and its copy, the audit log, listeners, the runtime's own, and the sockets
/// `accept` takes before admission closes them.
pub const FD_RESERVE: u64 = 256;

/// Logs the limits in force, raises the soft RLIMIT_NOFILE to the hard limit (the API's
/// connection cap is then fitted under it, `api_limits_within`), and warns when that is not
/// enough for NBD or when the byte budget is more memory than the machine has. Returns the
/// soft limit in force (`None`: unknown).
pub(super) fn log_limits(limits: &Limits) -> Option<u64> {
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
