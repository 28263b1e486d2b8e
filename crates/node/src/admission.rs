//! Which connections the node holds: the connection caps, and who makes room when they are
//! reached.
//!
//! Every accepted socket gets an entry here before its session starts, and loses it when the
//! session ends. Two caps apply: `max_connections` in all and `max_connections_per_ip` from one
//! client address — an IPv4 address, or an IPv6 /64 by default (`address_group`); a process on
//! the NBD Unix socket counts per uid instead (`origin`). A connection is *negotiating* from accept until the option that enters
//! transmission (GO or EXPORT_NAME) is answered, then *transmitting*.
//!
//! When a new connection would pass a cap, the node makes room by evicting a negotiating
//! connection, never a transmitting one (those carry I/O): for the per-address cap, that
//! address's oldest; for the global cap, the oldest of the address with the most negotiating
//! connections. Only when every connection in the way is transmitting is the new one closed.
//! So sockets that connect and never finish negotiating (idle, slow, or stuck in a TLS
//! handshake) can delay nobody: a client that completes its handshake in less time than it
//! takes the flood to open the cap's worth of new sockets gets in, and a flood from one
//! address evicts its own sockets first. The handshake deadline (`handshake_timeout_ms`) still
//! closes each of them in the end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use serde::Serialize;
use tokio::sync::Notify;

use crate::slots::Slots;

use crate::address_group::DEFAULT_IPV6_PREFIX_LEN;
use crate::origin::{Origin, OriginGroup};
use crate::sync::lock;

/// The connections of a node.
#[derive(Debug)]
pub struct Connections {
    max_connections: usize,
    max_per_ip: usize,
    /// IPv6 addresses sharing this many leading bits count as one client address.
    ipv6_prefix_len: u8,
    state: Mutex<State>,
    accepted_total: AtomicU64,
    refused_total: AtomicU64,
    evicted_total: AtomicU64,
    accept_errors_total: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u64, Entry>,
    per_group: HashMap<OriginGroup, usize>,
    next_id: u64,
}

#[derive(Debug)]
struct Entry {
    peer: Origin,
    /// The client it counts against (`Origin::group`).
    group: OriginGroup,
    accepted: Instant,
    /// Order of acceptance (ties in `accepted` are possible).
    seq: u64,
    phase: Phase,
    shared: Arc<ConnShared>,
}

#[derive(Debug, Clone)]
enum Phase {
    Negotiating,
    Transmitting {
        volume: String,
        tenant: Option<String>,
    },
}

/// What a session and the table share: the eviction signal and the numbers the API shows.
#[derive(Debug, Default)]
pub struct ConnShared {
    evicted: Notify,
    /// The session's request and byte slots once it transmits (for the in-flight counts).
    slots: OnceLock<SessionSlots>,
    peak_inflight_requests: AtomicUsize,
    peak_inflight_bytes: AtomicU64,
}

#[derive(Debug)]
struct SessionSlots {
    requests: Arc<Slots>,
    bytes: Arc<Slots>,
}

impl ConnShared {
    /// Completes when the connection has been evicted (while negotiating).
    pub async fn evicted(&self) {
        self.evicted.notified().await;
    }

    /// Registers the session's slots so the API can report what it holds.
    pub fn set_slots(&self, requests: Arc<Slots>, bytes: Arc<Slots>) {
        let _ = self.slots.set(SessionSlots { requests, bytes });
    }

    /// Requests and payload bytes (charged) held now.
    pub fn inflight(&self) -> (usize, u64) {
        match self.slots.get() {
            None => (0, 0),
            Some(s) => (
                s.requests.capacity().saturating_sub(s.requests.available()),
                u64::try_from(s.bytes.capacity().saturating_sub(s.bytes.available()))
                    .unwrap_or(u64::MAX),
            ),
        }
    }

    /// Records the counts after a request took its permits.
    pub fn note_inflight(&self) {
        let (requests, bytes) = self.inflight();
        self.peak_inflight_requests
            .fetch_max(requests, Ordering::Relaxed);
        self.peak_inflight_bytes.fetch_max(bytes, Ordering::Relaxed);
    }
}

/// Why a new connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{0} connections open, all transmitting")]
    Full(usize),
    #[error("{0} connections from this address open, all transmitting")]
    AddressFull(usize),
}

/// An admitted connection; dropping it frees its place.
#[derive(Debug)]
pub struct Admitted {
    table: Arc<Connections>,
    id: u64,
    shared: Arc<ConnShared>,
    /// Where the connection comes from (the TLS handshake limit groups by it).
    peer: Origin,
    /// The tenant the transport proved before negotiation (a Unix client's uid mapped by
    /// `[server] nbd_unix_tenants`); `None`: none, as for a TCP client.
    local_tenant: Option<String>,
    /// The connection evicted to make room, if any.
    pub evicted: Option<Origin>,
}

/// One connection in [`ConnectionsView`].
#[derive(Clone, Debug, Serialize)]
pub struct ConnectionView {
    pub peer: String,
    /// `negotiating` or `transmitting`.
    pub phase: &'static str,
    pub age_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// The volume's tenant (`None`: no tenant).
    pub tenant: Option<String>,
    pub inflight_requests: usize,
    pub peak_inflight_requests: usize,
    pub inflight_bytes: u64,
    pub peak_inflight_bytes: u64,
}

/// The table's state, for the API.
#[derive(Clone, Debug, Serialize)]
pub struct ConnectionsView {
    pub max_connections: usize,
    pub max_connections_per_ip: usize,
    pub open: usize,
    pub negotiating: usize,
    pub transmitting: usize,
    pub accepted_total: u64,
    /// Closed right after accept because every connection in the way was transmitting.
    pub refused_total: u64,
    /// Negotiating connections closed to make room for a new one.
    pub evicted_total: u64,
    /// `accept` calls that failed (EMFILE and the like), since start.
    pub accept_errors_total: u64,
    /// Oldest first.
    pub connections: Vec<ConnectionView>,
}

impl Connections {
    pub fn new(max_connections: usize, max_per_ip: usize) -> Arc<Connections> {
        Connections::with_ipv6_prefix(max_connections, max_per_ip, DEFAULT_IPV6_PREFIX_LEN)
    }

    /// As `new`, with IPv6 clients grouped by their first `ipv6_prefix_len` bits (1-128).
    pub fn with_ipv6_prefix(
        max_connections: usize,
        max_per_ip: usize,
        ipv6_prefix_len: u8,
    ) -> Arc<Connections> {
        Arc::new(Connections {
            max_connections: max_connections.max(1),
            max_per_ip: max_per_ip.clamp(1, max_connections.max(1)),
            ipv6_prefix_len,
            state: Mutex::new(State::default()),
            accepted_total: AtomicU64::new(0),
            refused_total: AtomicU64::new(0),
            evicted_total: AtomicU64::new(0),
            accept_errors_total: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Counts a failed `accept`.
    pub fn note_accept_error(&self) {
        self.accept_errors_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Admits a connection from `peer`, evicting a negotiating one if a cap is reached.
    pub fn admit(self: &Arc<Self>, peer: impl Into<Origin>) -> Result<Admitted, Refusal> {
        let peer = peer.into();
        let group = peer.group(self.ipv6_prefix_len);
        let mut state = self.lock();
        let mut evicted = None;
        let from_group = state.per_group.get(&group).copied().unwrap_or(0);
        if from_group >= self.max_per_ip {
            match Self::oldest_negotiating(&state, |entry_group| entry_group == group) {
                Some(victim) => evicted = Some(Self::evict(&mut state, victim)),
                None => {
                    self.refused_total.fetch_add(1, Ordering::Relaxed);
                    return Err(Refusal::AddressFull(from_group));
                }
            }
        }
        if evicted.is_none() && state.entries.len() >= self.max_connections {
            match Self::heaviest_negotiating_group(&state).and_then(|heavy| {
                Self::oldest_negotiating(&state, |entry_group| entry_group == heavy)
            }) {
                Some(victim) => evicted = Some(Self::evict(&mut state, victim)),
                None => {
                    self.refused_total.fetch_add(1, Ordering::Relaxed);
                    return Err(Refusal::Full(state.entries.len()));
                }
            }
        }
        if evicted.is_some() {
            self.evicted_total.fetch_add(1, Ordering::Relaxed);
        }
        let id = state.next_id;
        state.next_id += 1;
        let shared = Arc::new(ConnShared::default());
        state.entries.insert(
            id,
            Entry {
                peer: peer.clone(),
                group,
                accepted: Instant::now(),
                seq: id,
                phase: Phase::Negotiating,
                shared: Arc::clone(&shared),
            },
        );
        *state.per_group.entry(group).or_insert(0) += 1;
        self.accepted_total.fetch_add(1, Ordering::Relaxed);
        Ok(Admitted {
            table: Arc::clone(self),
            id,
            shared,
            peer,
            local_tenant: None,
            evicted,
        })
    }

    /// The negotiating connection accepted first among those whose client group passes `pick`.
    fn oldest_negotiating(state: &State, pick: impl Fn(OriginGroup) -> bool) -> Option<u64> {
        state
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.phase, Phase::Negotiating) && pick(e.group))
            .min_by_key(|(_, e)| e.seq)
            .map(|(&id, _)| id)
    }

    /// The client group (address group or local uid) with the most negotiating connections
    /// (ties: the one holding the oldest).
    fn heaviest_negotiating_group(state: &State) -> Option<OriginGroup> {
        let mut counts: HashMap<OriginGroup, (usize, u64)> = HashMap::new();
        for entry in state.entries.values() {
            if matches!(entry.phase, Phase::Negotiating) {
                let slot = counts.entry(entry.group).or_insert((0, u64::MAX));
                slot.0 += 1;
                slot.1 = slot.1.min(entry.seq);
            }
        }
        counts
            .into_iter()
            .max_by(|a, b| a.1.0.cmp(&b.1.0).then(b.1.1.cmp(&a.1.1)))
            .map(|(group, _)| group)
    }

    /// Tells every session, negotiating or transmitting, to end (its connection closes; its
    /// requests in flight get no reply); returns how many. Each leaves the table as its
    /// session ends.
    pub fn close_all(&self) -> usize {
        let state = lock(&self.state);
        for entry in state.entries.values() {
            entry.shared.evicted.notify_one();
        }
        state.entries.len()
    }

    /// Removes `id` (which must be negotiating) and tells its session to end.
    fn evict(state: &mut State, id: u64) -> Origin {
        let Some(entry) = state.entries.remove(&id) else {
            return Origin::Tcp(([0, 0, 0, 0], 0).into());
        };
        Self::forget_group(state, entry.group);
        entry.shared.evicted.notify_one();
        entry.peer
    }

    fn forget_group(state: &mut State, group: OriginGroup) {
        if let Some(count) = state.per_group.get_mut(&group) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                state.per_group.remove(&group);
            }
        }
    }

    /// The connections now, oldest first, with the counters.
    pub fn view(&self) -> ConnectionsView {
        let state = self.lock();
        let mut entries: Vec<&Entry> = state.entries.values().collect();
        entries.sort_by_key(|e| e.seq);
        let now = Instant::now();
        let connections: Vec<ConnectionView> = entries
            .iter()
            .map(|e| {
                let (inflight_requests, inflight_bytes) = e.shared.inflight();
                let (phase, volume, tenant) = match &e.phase {
                    Phase::Negotiating => ("negotiating", None, None),
                    Phase::Transmitting { volume, tenant } => {
                        ("transmitting", Some(volume.clone()), tenant.clone())
                    }
                };
                ConnectionView {
                    peer: e.peer.to_string(),
                    phase,
                    age_ms: u64::try_from(now.duration_since(e.accepted).as_millis())
                        .unwrap_or(u64::MAX),
                    volume,
                    tenant,
                    inflight_requests,
                    peak_inflight_requests: e.shared.peak_inflight_requests.load(Ordering::Relaxed),
                    inflight_bytes,
                    peak_inflight_bytes: e.shared.peak_inflight_bytes.load(Ordering::Relaxed),
                }
            })
            .collect();
        let transmitting = connections
            .iter()
            .filter(|c| c.phase == "transmitting")
            .count();
        ConnectionsView {
            max_connections: self.max_connections,
            max_connections_per_ip: self.max_per_ip,
            open: connections.len(),
            negotiating: connections.len() - transmitting,
            transmitting,
            accepted_total: self.accepted_total.load(Ordering::Relaxed),
            refused_total: self.refused_total.load(Ordering::Relaxed),
            evicted_total: self.evicted_total.load(Ordering::Relaxed),
            accept_errors_total: self.accept_errors_total.load(Ordering::Relaxed),
            connections,
        }
    }
}

impl Admitted {
    pub fn shared(&self) -> &Arc<ConnShared> {
        &self.shared
    }

    /// Where the connection was admitted from.
    pub fn peer(&self) -> &Origin {
        &self.peer
    }

    /// The tenant the transport proved before negotiation (a mapped local uid), if any.
    pub fn local_tenant(&self) -> Option<&str> {
        self.local_tenant.as_deref()
    }

    /// Sets [`Admitted::local_tenant`]: the Unix accept path, from the peer's uid.
    #[must_use]
    pub fn with_local_tenant(mut self, tenant: Option<String>) -> Admitted {
        self.local_tenant = tenant;
        self
    }

    /// Marks the connection transmitting, from when the reply that enters transmission is
    /// sent; from then on it is never evicted. `false`: it was evicted already, and must end.
    pub fn enter_transmission(&self, volume: &str, tenant: Option<&str>) -> bool {
        let mut state = self.table.lock();
        match state.entries.get_mut(&self.id) {
            Some(entry) => {
                entry.phase = Phase::Transmitting {
                    volume: volume.to_owned(),
                    tenant: tenant.map(str::to_owned),
                };
                true
            }
            None => false,
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self.table.lock();
        if let Some(entry) = state.entries.remove(&self.id) {
            Connections::forget_group(&mut state, entry.group);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::net::SocketAddr;

    use super::*;

    fn addr(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    #[test]
    fn a_full_table_evicts_the_oldest_negotiating_connection_of_the_heaviest_address() {
        let table = Connections::new(4, 4);
        let a1 = table.admit(addr([10, 0, 0, 1], 1)).unwrap();
        let b1 = table.admit(addr([10, 0, 0, 2], 1)).unwrap();
        let b2 = table.admit(addr([10, 0, 0, 2], 2)).unwrap();
        let a2 = table.admit(addr([10, 0, 0, 1], 2)).unwrap();
        assert!(a1.enter_transmission("v", None));
        // Full: 10.0.0.2 has two negotiating, 10.0.0.1 one (a2): b1 goes.
        let c = table.admit(addr([10, 0, 0, 3], 1)).unwrap();
        assert_eq!(c.evicted, Some(addr([10, 0, 0, 2], 1).into()));
        assert!(!b1.enter_transmission("v", None), "evicted stays evicted");
        // Tie between 10.0.0.1 (a2), .2 (b2) and .3 (c): the oldest of them, b2.
        let d = table.admit(addr([10, 0, 0, 4], 1)).unwrap();
        assert_eq!(d.evicted, Some(addr([10, 0, 0, 2], 2).into()));
        for conn in [&a2, &c, &d] {
            assert!(conn.enter_transmission("v", Some("t")));
        }
        // Everyone transmits: refused.
        assert_eq!(
            table.admit(addr([10, 0, 0, 5], 1)).unwrap_err(),
            Refusal::Full(4)
        );
        let view = table.view();
        assert_eq!((view.open, view.transmitting, view.negotiating), (4, 4, 0));
        assert_eq!((view.evicted_total, view.refused_total), (2, 1));
        drop((b1, b2));
        assert_eq!(table.view().open, 4, "evicted entries were gone already");
        drop(a1);
        assert!(table.admit(addr([10, 0, 0, 5], 1)).is_ok());
    }

    #[test]
    fn the_per_address_cap_evicts_that_address_only() {
        let table = Connections::new(10, 2);
        let a1 = table.admit(addr([10, 0, 0, 1], 1)).unwrap();
        let other = table.admit(addr([10, 0, 0, 2], 1)).unwrap();
        let a2 = table.admit(addr([10, 0, 0, 1], 2)).unwrap();
        let a3 = table.admit(addr([10, 0, 0, 1], 3)).unwrap();
        assert_eq!(a3.evicted, Some(addr([10, 0, 0, 1], 1).into()));
        assert!(other.enter_transmission("v", None));
        assert!(a2.enter_transmission("v", None));
        assert!(a3.enter_transmission("v", None));
        assert_eq!(
            table.admit(addr([10, 0, 0, 1], 4)).unwrap_err(),
            Refusal::AddressFull(2)
        );
        assert!(table.admit(addr([10, 0, 0, 3], 1)).is_ok());
        drop(a1);
    }

    #[test]
    fn one_ipv6_prefix_is_one_address_for_the_cap() {
        let v6 = |s: &str| SocketAddr::new(s.parse().unwrap(), 1);
        let table = Connections::new(10, 2);
        let a = table.admit(v6("2001:db8:0:1::1")).unwrap();
        let b = table.admit(v6("2001:db8:0:1:ffff::2")).unwrap();
        assert!(a.enter_transmission("v", None) && b.enter_transmission("v", None));
        // A third address of the same /64 is the same client: its two transmit, refused.
        assert_eq!(
            table.admit(v6("2001:db8:0:1:1234::3")).unwrap_err(),
            Refusal::AddressFull(2)
        );
        // The next /64 is another client.
        assert!(table.admit(v6("2001:db8:0:2::1")).is_ok());
        // With /128 every address is its own client.
        let exact = Connections::with_ipv6_prefix(10, 1, 128);
        let c = exact.admit(v6("2001:db8:0:1::1")).unwrap();
        assert!(c.enter_transmission("v", None));
        assert!(exact.admit(v6("2001:db8:0:1::2")).is_ok());
    }

    #[test]
    fn local_processes_count_per_uid_apart_from_every_address() {
        use crate::origin::LocalPeer;
        let local = |uid, pid| {
            Origin::Unix(LocalPeer {
                uid,
                gid: uid,
                pid: Some(pid),
            })
        };
        let table = Connections::new(10, 2);
        let a = table.admit(local(64055, 1)).unwrap();
        let b = table.admit(local(64055, 2)).unwrap();
        assert!(a.enter_transmission("v", None) && b.enter_transmission("v", None));
        // A third connection of the same uid is over the per-client cap...
        assert_eq!(
            table.admit(local(64055, 3)).unwrap_err(),
            Refusal::AddressFull(2)
        );
        // ...while another uid, and loopback TCP, are other clients.
        assert!(table.admit(local(1000, 4)).is_ok());
        assert!(table.admit(addr([127, 0, 0, 1], 1)).is_ok());
        let peers: Vec<String> = table
            .view()
            .connections
            .iter()
            .map(|c| c.peer.clone())
            .collect();
        assert_eq!(peers[0], "unix:uid=64055,gid=64055,pid=1");
    }

    #[tokio::test]
    async fn an_evicted_session_is_told() {
        let table = Connections::new(1, 1);
        let first = table.admit(addr([10, 0, 0, 1], 1)).unwrap();
        let _second = table.admit(addr([10, 0, 0, 2], 1)).unwrap();
        // The notification is stored: it is seen even when the session looks later.
        tokio::time::timeout(std::time::Duration::from_secs(5), first.shared().evicted())
            .await
            .expect("evicted");
    }
}
