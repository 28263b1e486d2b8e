//! Which client addresses count as one client for the per-address connection cap.
//!
//! Why: keyed on the full address, the cap is no cap for anyone who holds many addresses. An
//! IPv6 host is normally given a whole /64 (SLAAC, privacy addresses), so one machine can
//! connect from 2^64 addresses; the cap must count the /64, as mail servers and rate limiters
//! do. IPv4 addresses are scarce and count one by one; an IPv4-mapped IPv6 address (a dual-stack
//! socket's view of an IPv4 client) counts as the IPv4 address it maps. Loopback is not
//! special: each of 127.0.0.0/8 is its own IPv4 client and ::1 its own /64, so local processes
//! can pass the cap by choosing addresses (docs/operations.md, "Limits").

use std::net::{IpAddr, Ipv6Addr};

/// The IPv6 prefix length that makes one client (`[limits] ipv6_prefix_len`): a /64.
pub const DEFAULT_IPV6_PREFIX_LEN: u8 = 64;

/// The group `ip` counts in: the IPv4 address itself, or the first `ipv6_prefix_len` bits
/// of an IPv6 address (1 to 128; values outside are clamped) with the rest zero.
pub fn address_group(ip: IpAddr, ipv6_prefix_len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let len = u32::from(ipv6_prefix_len.clamp(1, 128));
                let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_counts_by_address_and_ipv6_by_its_prefix() {
        assert_eq!(address_group(ip("192.0.2.7"), 64), ip("192.0.2.7"));
        assert_ne!(
            address_group(ip("127.0.0.2"), 64),
            address_group(ip("127.0.0.3"), 64)
        );
        // One /64, two addresses: one client.
        let a = address_group(ip("2001:db8:1:2:aaaa::1"), 64);
        let b = address_group(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"), 64);
        assert_eq!(a, b);
        assert_eq!(a, ip("2001:db8:1:2::"));
        assert_ne!(a, address_group(ip("2001:db8:1:3::1"), 64));
        // Other prefix lengths.
        assert_eq!(address_group(ip("2001:db8:1:2::1"), 48), ip("2001:db8:1::"));
        assert_eq!(address_group(ip("2001:db8::1"), 128), ip("2001:db8::1"));
        assert_eq!(address_group(ip("2001:db8::1"), 1), ip("::"));
        assert_eq!(address_group(ip("2001:db8::1"), 0), ip("::"));
        assert_eq!(address_group(ip("::1"), 64), ip("::"));
        // A dual-stack socket's IPv4 client is that IPv4 address.
        assert_eq!(address_group(ip("::ffff:192.0.2.7"), 64), ip("192.0.2.7"));
    }
}
