//! A rate limit on TLS handshakes per client address group.
//!
//! Why: a TLS handshake costs the server an ECDHE key exchange and, with certificates, a
//! signature — about a millisecond of CPU on a connection thread that also carries other
//! tenants' sessions — and costs the client almost nothing (it can abort after the server's
//! first flight). The per-address connection cap bounds how many handshakes run at once, not
//! how many per second: a client that connects, starts TLS and hangs up in a loop would keep
//! the connection threads busy with handshakes. So each address group (IPv4 by address,
//! IPv6 by `ipv6_prefix_len`, as the connection caps group them, `address_group.rs`) gets a
//! token bucket: `per_s` handshakes per second, up to `2 × per_s` at once; a handshake over
//! it is refused before any cryptography runs (the session ends, the log says why). A local
//! process on the NBD Unix socket has no address: its bucket is its uid's (`origin`). NBD
//! clients open few connections and keep them, so a legitimate client does not meet it.
//!
//! The map of buckets is bounded (`MAX_TRACKED_GROUPS`): a group whose bucket is full again
//! is forgotten (a fresh bucket is the same), and when every tracked group is still short,
//! a new group is admitted without being tracked (memory stays bounded; the connection caps
//! still hold) and that is logged once.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::origin::{Origin, OriginGroup};
use crate::sync::lock;

/// Most address groups whose buckets are tracked at once.
pub const MAX_TRACKED_GROUPS: usize = 65_536;

/// Handshakes per second per address group by default: a hypervisor host that starts many
/// VMs at once opens a TLS connection per disk from one address, so the default is generous
/// (bursts of 200); it still caps one address at about a tenth of a core of handshake work.
pub const DEFAULT_HANDSHAKES_PER_S_PER_ADDRESS: u32 = 100;

/// The token buckets of every address group that started TLS lately.
#[derive(Debug)]
pub struct HandshakeLimiter {
    per_s: f64,
    burst: f64,
    ipv6_prefix_len: u8,
    max_groups: usize,
    buckets: Mutex<HashMap<OriginGroup, Bucket>>,
    overflow_logged: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl HandshakeLimiter {
    /// `per_s` handshakes per second per group, bursts of twice that; `per_s` 0: no limit.
    pub fn new(per_s: u32, ipv6_prefix_len: u8) -> HandshakeLimiter {
        Self::with_capacity(per_s, ipv6_prefix_len, MAX_TRACKED_GROUPS)
    }

    fn with_capacity(per_s: u32, ipv6_prefix_len: u8, max_groups: usize) -> HandshakeLimiter {
        HandshakeLimiter {
            per_s: f64::from(per_s),
            burst: f64::from(per_s) * 2.0,
            ipv6_prefix_len,
            max_groups,
            buckets: Mutex::new(HashMap::new()),
            overflow_logged: AtomicBool::new(false),
        }
    }

    /// Whether a handshake from `ip` may run at `now` (and takes its token if so).
    pub fn admit(&self, ip: IpAddr, now: Instant) -> bool {
        self.admit_origin(&Origin::Tcp((ip, 0).into()), now)
    }

    /// Whether a handshake from `origin` may run at `now`: a TCP client's address group, or
    /// a local process's uid, has one bucket.
    pub fn admit_origin(&self, origin: &Origin, now: Instant) -> bool {
        if self.per_s == 0.0 {
            return true;
        }
        let group = origin.group(self.ipv6_prefix_len);
        let mut buckets = lock(&self.buckets);
        let refill = |b: &Bucket| {
            let elapsed_s = now.saturating_duration_since(b.at).as_secs_f64();
            (b.tokens + elapsed_s * self.per_s).min(self.burst)
        };
        if !buckets.contains_key(&group) && buckets.len() >= self.max_groups {
            buckets.retain(|_, b| refill(b) < self.burst);
            if buckets.len() >= self.max_groups {
                if !self.overflow_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        groups = buckets.len(),
                        "TLS handshake limit: every tracked address group is short; new \
                         groups are admitted untracked"
                    );
                }
                return true;
            }
        }
        let bucket = buckets.entry(group).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let tokens = refill(bucket);
        bucket.at = now;
        if tokens >= 1.0 {
            bucket.tokens = tokens - 1.0;
            true
        } else {
            bucket.tokens = tokens;
            false
        }
    }

    /// The bucket `origin` draws on.
    pub fn group_of(&self, origin: &Origin) -> OriginGroup {
        origin.group(self.ipv6_prefix_len)
    }

    /// Address groups tracked now.
    pub fn tracked_groups(&self) -> usize {
        lock(&self.buckets).len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_burst_of_twice_the_rate_then_the_rate() {
        let limiter = HandshakeLimiter::new(5, 64);
        let t0 = Instant::now();
        let admitted = (0..20)
            .filter(|_| limiter.admit(ip("10.0.0.1"), t0))
            .count();
        assert_eq!(admitted, 10, "the burst is twice the rate");
        // Another address is not held back by the first.
        assert!(limiter.admit(ip("10.0.0.2"), t0));
        // A second later, five more.
        let t1 = t0 + Duration::from_secs(1);
        let admitted = (0..20)
            .filter(|_| limiter.admit(ip("10.0.0.1"), t1))
            .count();
        assert_eq!(admitted, 5);
        // Refused attempts do not earn tokens: 100 ms later there is half a token.
        assert!(!limiter.admit(ip("10.0.0.1"), t1 + Duration::from_millis(100)));
    }

    #[test]
    fn ipv6_addresses_of_one_prefix_share_a_bucket() {
        let limiter = HandshakeLimiter::new(1, 64);
        let t = Instant::now();
        assert!(limiter.admit(ip("2001:db8:1:2::1"), t));
        assert!(limiter.admit(ip("2001:db8:1:2::ffff"), t));
        assert!(
            !limiter.admit(ip("2001:db8:1:2:aaaa::7"), t),
            "the same /64 is one client"
        );
        assert!(limiter.admit(ip("2001:db8:1:3::1"), t), "another /64");
    }

    #[test]
    fn each_local_uid_has_its_own_bucket() {
        let limiter = HandshakeLimiter::new(1, 64);
        let t = Instant::now();
        let local = |uid| {
            Origin::Unix(crate::origin::LocalPeer {
                uid,
                gid: 0,
                pid: None,
            })
        };
        assert!(limiter.admit_origin(&local(1000), t));
        assert!(limiter.admit_origin(&local(1000), t));
        assert!(
            !limiter.admit_origin(&local(1000), t),
            "uid 1000's burst is spent"
        );
        assert!(limiter.admit_origin(&local(1001), t), "another uid");
        assert!(
            limiter.admit(ip("127.0.0.1"), t),
            "loopback TCP is not a uid"
        );
    }

    #[test]
    fn zero_is_no_limit() {
        let limiter = HandshakeLimiter::new(0, 64);
        let t = Instant::now();
        assert!((0..1000).all(|_| limiter.admit(ip("10.0.0.1"), t)));
        assert_eq!(limiter.tracked_groups(), 0);
    }

    #[test]
    fn the_map_stays_bounded_and_forgets_full_buckets_first() {
        let limiter = HandshakeLimiter::with_capacity(1, 64, 4);
        let t0 = Instant::now();
        for i in 1..=4 {
            assert!(limiter.admit(ip(&format!("10.0.0.{i}")), t0));
        }
        // Every bucket is short at t0: a fifth group is admitted but not tracked.
        assert!(limiter.admit(ip("10.0.0.5"), t0));
        assert_eq!(limiter.tracked_groups(), 4);
        // Two seconds later the buckets are full again: forgotten, the new group tracked.
        let t1 = t0 + Duration::from_secs(2);
        assert!(limiter.admit(ip("10.0.0.6"), t1));
        assert_eq!(limiter.tracked_groups(), 1);
    }
}
