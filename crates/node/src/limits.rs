//! The limits that bound what one client can make the node hold: requests and bytes in
//! flight per connection, tenant and node, connection counts and timeouts, each checked by
//! `Limits::validate` wherever a `Limits` is built.

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
        // The per-connection byte budget stays below 4 GiB, the range the configuration
        // documents (it was a semaphore of u32 permits).
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

#[cfg(test)]
mod tests {
    use super::*;

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
