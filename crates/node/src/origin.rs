//! Where a connection comes from: a TCP client's address, or a local process on the NBD Unix
//! socket, known by the credentials the kernel recorded when it connected (`SO_PEERCRED`).
//!
//! Why a type of its own: the connection caps and the TLS handshake limit count clients, and
//! they used to count only IP addresses (`address_group`). A process on the Unix socket has
//! no address; dressing it up as 127.0.0.1 would put every local client, of every user, in
//! one group and let anyone exhaust the per-address cap for the hypervisor. The kernel's uid
//! is the local client's identity that nobody can forge, so a Unix client counts per uid
//! ([`OriginGroup::Uid`]), a TCP client per address group as before.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use crate::address_group::address_group;

/// The other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A TCP client (or an in-process client that names an address).
    Tcp(SocketAddr),
    /// A process on the NBD Unix socket.
    Unix(LocalPeer),
}

/// A local process's credentials as the kernel recorded them at `connect` (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPeer {
    pub uid: u32,
    pub gid: u32,
    /// The connecting process, when the kernel knows it (informational only: pids are reused).
    pub pid: Option<i32>,
}

/// What one client is for the connection caps and the handshake limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OriginGroup {
    /// A TCP client's address group (`address_group`).
    Address(IpAddr),
    /// Every connection of one local user on the Unix socket.
    Uid(u32),
}

impl Origin {
    /// The group the origin counts in; IPv6 addresses group by their first `ipv6_prefix_len`
    /// bits.
    pub fn group(&self, ipv6_prefix_len: u8) -> OriginGroup {
        match self {
            Origin::Tcp(addr) => OriginGroup::Address(address_group(addr.ip(), ipv6_prefix_len)),
            Origin::Unix(peer) => OriginGroup::Uid(peer.uid),
        }
    }

    /// The TCP address, if it is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Origin::Tcp(addr) => Some(*addr),
            Origin::Unix(_) => None,
        }
    }
}

impl From<SocketAddr> for Origin {
    fn from(addr: SocketAddr) -> Origin {
        Origin::Tcp(addr)
    }
}

impl fmt::Display for Origin {
    /// A TCP address as `ip:port`; a local process as `unix:uid=U,gid=G,pid=P` (what
    /// `GET /v1/connections` shows as the peer).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Tcp(addr) => write!(f, "{addr}"),
            Origin::Unix(peer) => {
                write!(f, "unix:uid={},gid={}", peer.uid, peer.gid)?;
                match peer.pid {
                    Some(pid) => write!(f, ",pid={pid}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl fmt::Display for OriginGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OriginGroup::Address(ip) => write!(f, "address group {ip}"),
            OriginGroup::Uid(uid) => write!(f, "local uid {uid}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_local_process_counts_by_uid_and_never_as_an_address() {
        let local = |uid, pid| {
            Origin::Unix(LocalPeer {
                uid,
                gid: 100,
                pid: Some(pid),
            })
        };
        assert_eq!(local(1000, 1).group(64), local(1000, 2).group(64));
        assert_ne!(local(1000, 1).group(64), local(1001, 1).group(64));
        let loopback = Origin::Tcp("127.0.0.1:5".parse().unwrap());
        assert_ne!(local(0, 1).group(64), loopback.group(64));
        assert_eq!(local(1000, 7).to_string(), "unix:uid=1000,gid=100,pid=7");
        assert_eq!(loopback.to_string(), "127.0.0.1:5");
        assert_eq!(local(1, 1).tcp(), None);
    }
}
