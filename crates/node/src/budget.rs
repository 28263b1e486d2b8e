//! The node-wide memory budget: payload bytes in flight, bounded per connection, per tenant and
//! per node, and handed out so that every connection can always make progress.
//!
//! A session charges every READ and WRITE the buffer it will occupy (`BufferPool::charge_bytes`)
//! before it reads the payload or runs the read, and gives it back when the reply is on the
//! wire. The node's bytes (`max_inflight_bytes_per_node`) are two pools:
//!
//! * a reserve of `reserved_bytes_per_session` for every connection the node admits
//!   (`Limits::reserved_inflight_bytes_per_conn`: a quarter of the node budget split between
//!   `max_connections`, 1 MiB with the defaults). A charge that fits in what its own session
//!   has left of its reserve is granted at once, whatever anyone else holds or waits for;
//! * the shared pool, everything else, where every larger charge goes, under two bounds:
//!   per tenant (`max_inflight_bytes_per_tenant`; "no tenant" is one tenant) and the pool's
//!   size. Before either, the session's own semaphore (`max_inflight_bytes_per_conn`) is
//!   taken, so a connection waiting for its own replies to drain never queues here, and one
//!   connection never holds more than that of its tenant's bytes.
//!
//! Why a reserve: bytes held by a client that never reads its replies come back only when its
//! session ends, so no order of granting can take them back. Two such clients fill an
//! anonymous tenant's 256 MiB, and with one shared pool every other connection of that tenant
//! (in the default setup without TLS, every client) waited for the reply stall timeout (60 s).
//! The reserve is outside what greedy connections can take, so a connection with a small
//! request in flight or none is always served; the reserve's size bounds the memory that
//! guarantee costs (`max_connections` reserves at most, never more than the node budget).
//!
//! A charge of the shared pool that does not fit waits; the session stops reading its socket
//! meanwhile (TCP pushes back on the client), it does not fail. Waiting charges are granted in
//! round robin over tenants and in arrival order within a tenant (a session has at most one
//! waiting charge, so this is round robin over its connections too). A tenant whose next
//! charge would pass its own bound is skipped: it waits for its own replies, not for anyone
//! else. A tenant whose next charge does not fit in the pool's free bytes stops the round:
//! nobody behind it may take the bytes it waits for, so a large request is not starved by a
//! stream of small ones.
//!
//! What this guarantees: no tenant holds more than its bound of the shared pool, so the other
//! tenants always share at least `shared - per_tenant` between them; every connection can
//! always have up to its reserve in flight; a waiting charge is granted once the holders
//! ahead of it give back enough, in a bounded number of grants; and the node never holds more
//! than `max_inflight_bytes_per_node`. What it cannot guarantee alone: a connection whose
//! requests are larger than its reserve waits for the shared pool, which clients that never
//! read their replies can keep full (`shared / per_tenant` such tenants, or a tenant's
//! `per_tenant / max_inflight_bytes_per_conn` connections); the reply stall timeout
//! (`Limits::client_stall_timeout_ms`) is what ends them.
//!
//! A charge from a reserve takes no lock: the session's, the node's and the tenant's reserve
//! counters are compare-and-swaps against their bounds, so the common request (4 KiB, well
//! within a 1 MiB reserve) touches no node-wide lock on its way in or out. Only the shared
//! pool, its line and the tenants' entries are under the lock. A give-back to a reserve
//! takes the lock only when its session has a charge in the line (which may fit the reserve
//! now) or has ended (its tenant may be forgotten); a charge that goes to the line marks
//! itself waiting first and then tries its reserve once more, so a give-back racing it either
//! frees bytes that try sees or sees the mark.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rustc_hash::FxHashMap;
use serde::Serialize;
use tokio::sync::oneshot;

use crate::sync::lock;

/// Why a charge can never be granted.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("a charge of {charge_bytes} bytes exceeds the tenant budget of {tenant_bytes} bytes")]
    TooLarge {
        charge_bytes: u64,
        tenant_bytes: u64,
    },
    #[error("the node is shutting down")]
    Closed,
}

/// The budget of a node.
#[derive(Debug)]
pub struct Budget {
    per_tenant_bytes: u64,
    per_node_bytes: u64,
    /// What each session may hold outside the shared pool.
    reserved_per_session_bytes: u64,
    /// All sessions' reserves together (at most the node budget); the shared pool is the rest.
    reserve_bytes: u64,
    /// What the node holds.
    held: Held,
    state: Mutex<State>,
}

/// What the node or one tenant holds, readable without the budget's lock.
///
/// The shared pool's bytes change under the lock only; the reserves' bytes change without it
/// (a reserve charge is a compare-and-swap on the session's, the node's and the tenant's
/// counters: the common 4 KiB request takes no node-wide lock). The peak is noted by every
/// take, from the two counters as that take reads them.
#[derive(Debug, Default)]
struct Held {
    shared_bytes: AtomicU64,
    reserved_bytes: AtomicU64,
    peak_bytes: AtomicU64,
}

impl Held {
    fn shared(&self) -> u64 {
        self.shared_bytes.load(Ordering::Relaxed)
    }

    fn reserved(&self) -> u64 {
        self.reserved_bytes.load(Ordering::SeqCst)
    }

    /// Books `bytes` of the shared pool (with the budget's lock held).
    fn add_shared(&self, bytes: u64) {
        let shared = self.shared() + bytes;
        self.shared_bytes.store(shared, Ordering::Relaxed);
        self.note_peak(shared + self.reserved());
    }

    /// Gives back `bytes` of the shared pool (with the budget's lock held).
    fn sub_shared(&self, bytes: u64) {
        debug_assert!(
            self.shared() >= bytes,
            "{bytes} shared bytes given back, more than held"
        );
        self.shared_bytes
            .store(self.shared().saturating_sub(bytes), Ordering::Relaxed);
    }

    /// Books `bytes` of the reserves; `Some(limit)`: only if the total stays within it.
    fn add_reserved(&self, bytes: u64, limit: Option<u64>) -> bool {
        let taken = self
            .reserved_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                let after = held.checked_add(bytes)?;
                limit.is_none_or(|limit| after <= limit).then_some(after)
            });
        match taken {
            Ok(before) => {
                self.note_peak(before + bytes + self.shared());
                true
            }
            Err(_) => false,
        }
    }

    fn sub_reserved(&self, bytes: u64) {
        let before = self.reserved_bytes.fetch_sub(bytes, Ordering::SeqCst);
        debug_assert!(
            before >= bytes,
            "{bytes} reserved bytes given back, more than held"
        );
    }

    fn note_peak(&self, total: u64) {
        if total > self.peak_bytes.load(Ordering::Relaxed) {
            self.peak_bytes.fetch_max(total, Ordering::Relaxed);
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Tenants with sessions, held bytes or waiting charges (looked up on every shared-pool
    /// charge and release: FxHash, the ids are the budget's own).
    tenants: FxHashMap<TenantId, TenantState>,
    /// Tenant id by tenant name (`None`: volumes without a tenant).
    ids: HashMap<Option<String>, TenantId>,
    next_tenant: u64,
    /// Tenants with waiting charges, in round-robin order (each at most once).
    ring: VecDeque<TenantId>,
    next_waiter: u64,
    /// Charges that had to wait, since start.
    waited_total: u64,
}

/// A tenant's number in the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TenantId(u64);

#[derive(Debug)]
struct TenantState {
    name: Option<String>,
    sessions: usize,
    /// What its sessions hold (shared with their reserves, which count without the lock).
    held: Arc<Held>,
    waiters: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    bytes: u64,
    /// The waiting session's reserve: a waiter that fits in it once it frees up is granted
    /// from it.
    session: Arc<SessionReserve>,
    /// `true`: granted from the session's reserve, `false`: from the shared pool.
    granted: oneshot::Sender<bool>,
}

/// One session's reserve, shared by its account and every charge taken from it (which may
/// outlive the session: the reserve's bytes come back when the last reply is written).
#[derive(Debug)]
struct SessionReserve {
    /// Held of this reserve.
    held_bytes: AtomicU64,
    /// The tenant's counters.
    tenant: Arc<Held>,
    /// Charges of this session waiting in its tenant's line (changed under the lock): while
    /// there are some, a give-back to the reserve takes the lock, to move one there if it fits.
    waiting: AtomicUsize,
    /// The session's account is gone: a give-back then takes the lock, so that the tenant is
    /// forgotten once nothing is held.
    closed: AtomicBool,
}

/// A session's membership in its tenant's account; the tenant's entry goes when its last
/// session ends and nothing is held.
#[derive(Debug)]
pub struct TenantAccount {
    budget: Arc<Budget>,
    tenant: TenantId,
    reserve: Arc<SessionReserve>,
}

/// Bytes held against the budget until dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    tenant: TenantId,
    bytes: u64,
    /// `Some`: taken from this session's reserve, not from the shared pool.
    reserve: Option<Arc<SessionReserve>>,
}

/// One tenant in [`BudgetView`].
#[derive(Clone, Debug, Serialize)]
pub struct TenantView {
    /// `None`: the volumes without a tenant.
    pub tenant: Option<String>,
    pub sessions: usize,
    /// Held in all, of the shared pool and of its sessions' reserves.
    pub inflight_bytes: u64,
    /// Of that, held of its sessions' reserves.
    pub reserved_inflight_bytes: u64,
    pub peak_inflight_bytes: u64,
    pub waiting_charges: usize,
}

/// The budget's state, for the API.
#[derive(Clone, Debug, Serialize)]
pub struct BudgetView {
    pub max_inflight_bytes_per_node: u64,
    pub max_inflight_bytes_per_tenant: u64,
    /// What each connection may hold outside the shared pool (0: no reserve).
    pub reserved_inflight_bytes_per_conn: u64,
    /// The shared pool: the node budget less every connection's reserve.
    pub shared_inflight_bytes: u64,
    /// Held in all, of the shared pool and of the reserves.
    pub inflight_bytes: u64,
    /// Of that, held of the connections' reserves.
    pub reserved_inflight_bytes: u64,
    /// Most bytes held at once since the node started.
    pub peak_inflight_bytes: u64,
    /// Charges that could not be granted at once, since the node started.
    pub waited_charges_total: u64,
    pub tenants: Vec<TenantView>,
}

impl Budget {
    /// A budget without reserves: every charge comes from one pool of `per_node_bytes`.
    pub fn new(per_tenant_bytes: u64, per_node_bytes: u64) -> Arc<Budget> {
        Self::with_reserve(per_tenant_bytes, per_node_bytes, 0, 0)
    }

    /// A budget that keeps `reserved_per_session_bytes` for each of `sessions` sessions out
    /// of the shared pool (the reserves together are cut to the node budget).
    pub fn with_reserve(
        per_tenant_bytes: u64,
        per_node_bytes: u64,
        reserved_per_session_bytes: u64,
        sessions: usize,
    ) -> Arc<Budget> {
        let sessions = u64::try_from(sessions).unwrap_or(u64::MAX);
        let reserve_bytes = reserved_per_session_bytes
            .saturating_mul(sessions)
            .min(per_node_bytes);
        Arc::new(Budget {
            per_tenant_bytes,
            per_node_bytes,
            reserved_per_session_bytes,
            reserve_bytes,
            held: Held::default(),
            state: Mutex::new(State::default()),
        })
    }

    /// The shared pool's size: the node budget less the reserves.
    fn shared_bytes(&self) -> u64 {
        self.per_node_bytes - self.reserve_bytes
    }

    /// The largest charge that can ever be granted: within a tenant's bound and the pool.
    fn largest_charge_bytes(&self) -> u64 {
        self.per_tenant_bytes.min(self.shared_bytes())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Joins `tenant`'s account for the life of a session.
    pub fn join(self: &Arc<Self>, tenant: Option<&str>) -> TenantAccount {
        let mut state = self.lock();
        let key = tenant.map(str::to_owned);
        let id = match state.ids.get(&key) {
            Some(&id) => id,
            None => {
                let id = TenantId(state.next_tenant);
                state.next_tenant += 1;
                state.ids.insert(key.clone(), id);
                state.tenants.insert(
                    id,
                    TenantState {
                        name: key,
                        sessions: 0,
                        held: Arc::new(Held::default()),
                        waiters: VecDeque::new(),
                    },
                );
                id
            }
        };
        let held = match state.tenants.get_mut(&id) {
            Some(entry) => {
                entry.sessions += 1;
                Arc::clone(&entry.held)
            }
            None => Arc::new(Held::default()),
        };
        TenantAccount {
            budget: Arc::clone(self),
            tenant: id,
            reserve: Arc::new(SessionReserve {
                held_bytes: AtomicU64::new(0),
                tenant: held,
                waiting: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// What is held now, by whom, and the peaks.
    pub fn view(&self) -> BudgetView {
        let state = self.lock();
        let mut tenants: Vec<TenantView> = state
            .tenants
            .values()
            .map(|t| TenantView {
                tenant: t.name.clone(),
                sessions: t.sessions,
                inflight_bytes: t.held.shared() + t.held.reserved(),
                reserved_inflight_bytes: t.held.reserved(),
                peak_inflight_bytes: t.held.peak_bytes.load(Ordering::Relaxed),
                waiting_charges: t.waiters.len(),
            })
            .collect();
        tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        BudgetView {
            max_inflight_bytes_per_node: self.per_node_bytes,
            max_inflight_bytes_per_tenant: self.per_tenant_bytes,
            reserved_inflight_bytes_per_conn: self.reserved_per_session_bytes,
            shared_inflight_bytes: self.shared_bytes(),
            inflight_bytes: self.held.shared() + self.held.reserved(),
            reserved_inflight_bytes: self.held.reserved(),
            peak_inflight_bytes: self.held.peak_bytes.load(Ordering::Relaxed),
            waited_charges_total: state.waited_total,
            tenants,
        }
    }

    /// Grants waiting charges in round-robin order until the tenant at the front of the ring
    /// does not fit in the shared pool's free bytes, or no tenant's next charge fits under its own
    /// bound. Called with the lock held after anything that may let a charge through.
    fn grant_waiting(&self, state: &mut State) {
        let mut skipped = 0;
        while skipped < state.ring.len() {
            let Some(&tenant) = state.ring.front() else {
                return;
            };
            let Some(entry) = state.tenants.get_mut(&tenant) else {
                state.ring.pop_front();
                continue;
            };
            let Some(head_bytes) = entry.waiters.front().map(|w| w.bytes) else {
                state.ring.pop_front();
                continue;
            };
            if entry.held.shared() + head_bytes > self.per_tenant_bytes {
                // Waits for its own tenant's replies; others may go on.
                state.ring.rotate_left(1);
                skipped += 1;
                continue;
            }
            if self.held.shared() + head_bytes > self.shared_bytes() {
                // First in line for the pool's free bytes: nobody passes it.
                return;
            }
            let Some(waiter) = entry.waiters.pop_front() else {
                continue;
            };
            entry.held.add_shared(waiter.bytes);
            let more = !entry.waiters.is_empty();
            self.held.add_shared(waiter.bytes);
            waiter.session.waiting.fetch_sub(1, Ordering::SeqCst);
            // A waiter whose session is gone: its guard gives the bytes back (it finds itself
            // no longer queued), so nothing is lost here.
            let _ = waiter.granted.send(false);
            state.ring.pop_front();
            if more {
                state.ring.push_back(tenant);
            }
            skipped = 0;
        }
    }

    /// Whether a waiting charge is first in line for the shared pool's free bytes. Between
    /// rounds every tenant in the ring waits either for its own bound or for the pool (a charge that
    /// fits both would have been granted), so it is one whose next charge fits its own bound.
    fn node_is_awaited(&self, state: &State) -> bool {
        state.ring.iter().any(|tenant| {
            state.tenants.get(tenant).is_some_and(|entry| {
                entry
                    .waiters
                    .front()
                    .is_some_and(|w| entry.held.shared() + w.bytes <= self.per_tenant_bytes)
            })
        })
    }

    /// Gives back a charge of the shared pool.
    fn release_shared(&self, tenant: TenantId, bytes: u64) {
        let mut state = self.lock();
        if let Some(entry) = state.tenants.get(&tenant) {
            entry.held.sub_shared(bytes);
        }
        self.held.sub_shared(bytes);
        Self::forget_if_unused(&mut state, tenant);
        if !state.ring.is_empty() {
            self.grant_waiting(&mut state);
        }
    }

    /// Gives back a charge of a session's reserve: without the lock, unless the session has a
    /// charge waiting in its tenant's line (which may fit the reserve now: a connection whose
    /// reserve drains is never left waiting for bytes others hold) or its account is gone.
    fn release_reserved(&self, tenant: TenantId, bytes: u64, reserve: &SessionReserve) {
        self.give_back_reserved(reserve, bytes);
        // After the give-back (SeqCst), so that a charge that marks itself waiting and then
        // tries the reserve again either sees these bytes or is seen here.
        if reserve.waiting.load(Ordering::SeqCst) == 0 && !reserve.closed.load(Ordering::SeqCst) {
            return;
        }
        let mut state = self.lock();
        let state = &mut *state;
        let mut moved_any = false;
        loop {
            let moved = state.tenants.get_mut(&tenant).and_then(|entry| {
                let index = entry.waiters.iter().position(|w| {
                    std::ptr::eq(Arc::as_ptr(&w.session), reserve)
                        && self.try_take_reserved(&w.session, w.bytes)
                })?;
                entry.waiters.remove(index)
            });
            let Some(waiter) = moved else {
                break;
            };
            waiter.session.waiting.fetch_sub(1, Ordering::SeqCst);
            let _ = waiter.granted.send(true);
            moved_any = true;
        }
        if moved_any {
            if state
                .tenants
                .get(&tenant)
                .is_some_and(|t| t.waiters.is_empty())
            {
                state.ring.retain(|&t| t != tenant);
            }
            // One may have been the head that stopped the round.
            self.grant_waiting(state);
        }
        Self::forget_if_unused(state, tenant);
    }

    /// Books `bytes` of the session reserve `reserve` if they fit in what is left of it and
    /// of all the reserves together (which bounds the reserves of sessions past
    /// `max_connections`, such as requests of an ended session still on their way out).
    /// Lock-free: both bounds are compare-and-swaps, so neither is passed by takes racing on
    /// other threads (the session's next request, a waiter moved by a give-back).
    fn try_take_reserved(&self, reserve: &SessionReserve, bytes: u64) -> bool {
        if bytes == 0 {
            return false;
        }
        let fits_session = reserve
            .held_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                let after = held.checked_add(bytes)?;
                (after <= self.reserved_per_session_bytes).then_some(after)
            })
            .is_ok();
        if !fits_session {
            return false;
        }
        if !self.held.add_reserved(bytes, Some(self.reserve_bytes)) {
            reserve.held_bytes.fetch_sub(bytes, Ordering::SeqCst);
            return false;
        }
        reserve.tenant.add_reserved(bytes, None);
        true
    }

    fn give_back_reserved(&self, reserve: &SessionReserve, bytes: u64) {
        // Conservation: nothing is given back that was not taken (a debug build stops here).
        let before = reserve.held_bytes.fetch_sub(bytes, Ordering::SeqCst);
        debug_assert!(
            before >= bytes,
            "{bytes} reserved bytes given back, more than held"
        );
        reserve.tenant.sub_reserved(bytes);
        self.held.sub_reserved(bytes);
    }

    fn forget_if_unused(state: &mut State, tenant: TenantId) {
        let unused = state.tenants.get(&tenant).is_some_and(|t| {
            t.sessions == 0
                && t.held.shared() == 0
                && t.held.reserved() == 0
                && t.waiters.is_empty()
        });
        if unused && let Some(entry) = state.tenants.remove(&tenant) {
            state.ids.remove(&entry.name);
        }
    }
}

impl TenantAccount {
    /// [`TenantAccount::charge`] when the bytes fit in what is left of this session's reserve
    /// (taken at once, without the lock); `None` when the charge would have to go to the
    /// shared pool, where it might wait.
    pub fn charge_now(&self, bytes: u64) -> Option<Charge> {
        let budget = &self.budget;
        (bytes <= budget.largest_charge_bytes() && budget.try_take_reserved(&self.reserve, bytes))
            .then(|| self.reserved_charge(bytes))
    }

    /// Takes `bytes` from this session's reserve when they fit in what is left of it, at
    /// once; else from the tenant's and the node's shared pool, waiting (in fair order) until
    /// they fit. Cancel-safe: dropping the future gives back whatever it was granted.
    pub async fn charge(&self, bytes: u64) -> Result<Charge, BudgetError> {
        let budget = &self.budget;
        // `Limits` keeps the largest request's charge within both (and a reserve within it).
        if bytes > budget.largest_charge_bytes() {
            return Err(BudgetError::TooLarge {
                charge_bytes: bytes,
                tenant_bytes: budget.largest_charge_bytes(),
            });
        }
        // The session's own reserve first, without the lock: nobody else can have taken it.
        if let Some(charge) = self.charge_now(bytes) {
            return Ok(charge);
        }
        let charge = |bytes| Charge {
            budget: Arc::clone(budget),
            tenant: self.tenant,
            bytes,
            reserve: None,
        };
        let (waiter_id, granted) = {
            let mut state = budget.lock();
            let state = &mut *state;
            if !state.tenants.contains_key(&self.tenant) {
                return Err(BudgetError::Closed);
            }
            // Marked waiting before the reserve is tried again: a give-back to it since the
            // try above either shows here or sees the mark and moves this charge there.
            self.reserve.waiting.fetch_add(1, Ordering::SeqCst);
            if budget.try_take_reserved(&self.reserve, bytes) {
                self.reserve.waiting.fetch_sub(1, Ordering::SeqCst);
                return Ok(self.reserved_charge(bytes));
            }
            let Some(entry) = state.tenants.get(&self.tenant) else {
                self.reserve.waiting.fetch_sub(1, Ordering::SeqCst);
                return Err(BudgetError::Closed);
            };
            // At once when the round would grant it: this tenant has no earlier charge waiting,
            // no other tenant waits for the node's free bytes (those in the ring wait for their
            // own bound), and it fits.
            let first_in_tenant = entry.waiters.is_empty();
            let fits = entry.held.shared() + bytes <= budget.per_tenant_bytes
                && budget.held.shared() + bytes <= budget.shared_bytes();
            let at_once = first_in_tenant && fits && !budget.node_is_awaited(state);
            let Some(entry) = state.tenants.get_mut(&self.tenant) else {
                self.reserve.waiting.fetch_sub(1, Ordering::SeqCst);
                return Err(BudgetError::Closed);
            };
            if at_once {
                self.reserve.waiting.fetch_sub(1, Ordering::SeqCst);
                entry.held.add_shared(bytes);
                budget.held.add_shared(bytes);
                return Ok(charge(bytes));
            }
            let (tx, rx) = oneshot::channel();
            let id = state.next_waiter;
            state.next_waiter += 1;
            state.waited_total += 1;
            if first_in_tenant {
                state.ring.push_back(self.tenant);
            }
            entry.waiters.push_back(Waiter {
                id,
                bytes,
                session: Arc::clone(&self.reserve),
                granted: tx,
            });
            budget.grant_waiting(state);
            (id, rx)
        };
        // From here until the grant is received, dropping this future leaves the guard to
        // undo whatever happened (no `Charge` exists yet, so nothing is given back twice).
        let mut guard = WaitGuard {
            budget,
            tenant: self.tenant,
            waiter: waiter_id,
            bytes,
            reserve: &self.reserve,
            granted: Some(granted),
        };
        let outcome = match guard.granted.as_mut() {
            Some(granted) => granted.await,
            None => return Err(BudgetError::Closed),
        };
        guard.granted = None;
        match outcome {
            Ok(false) => Ok(charge(bytes)),
            Ok(true) => Ok(self.reserved_charge(bytes)),
            // The sender is dropped unsent only if the waiter left the queue without a grant,
            // which only this future's guard does.
            Err(_) => Err(BudgetError::Closed),
        }
    }

    /// A charge of `bytes` booked on this session's reserve.
    fn reserved_charge(&self, bytes: u64) -> Charge {
        Charge {
            budget: Arc::clone(&self.budget),
            tenant: self.tenant,
            bytes,
            reserve: Some(Arc::clone(&self.reserve)),
        }
    }

    /// What this session holds of its reserve.
    #[cfg(test)]
    fn reserved_bytes(&self) -> u64 {
        self.reserve.held_bytes.load(Ordering::SeqCst)
    }
}

impl Drop for TenantAccount {
    fn drop(&mut self) {
        // Before the lock (SeqCst): a give-back to the reserve from now on takes the lock and
        // forgets the tenant if it was the last thing held; one before is seen below.
        self.reserve.closed.store(true, Ordering::SeqCst);
        let mut state = self.budget.lock();
        if let Some(entry) = state.tenants.get_mut(&self.tenant) {
            entry.sessions = entry.sessions.saturating_sub(1);
        }
        Budget::forget_if_unused(&mut state, self.tenant);
    }
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        match self.reserve.as_deref() {
            Some(reserve) => self
                .budget
                .release_reserved(self.tenant, self.bytes, reserve),
            None => self.budget.release_shared(self.tenant, self.bytes),
        }
    }
}

/// Cleans up after a waiting charge whose future was dropped: removes it from its queue, or,
/// when it was granted in the meantime, gives the bytes back.
struct WaitGuard<'a> {
    budget: &'a Arc<Budget>,
    tenant: TenantId,
    waiter: u64,
    bytes: u64,
    reserve: &'a Arc<SessionReserve>,
    /// `None` once the outcome was received (then there is nothing to undo).
    granted: Option<oneshot::Receiver<bool>>,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        let Some(mut granted) = self.granted.take() else {
            return;
        };
        let mut state = self.budget.lock();
        let state = &mut *state;
        let queued = state.tenants.get_mut(&self.tenant).and_then(|entry| {
            let index = entry.waiters.iter().position(|w| w.id == self.waiter)?;
            entry.waiters.remove(index)
        });
        if queued.is_some() {
            // This one no longer waits.
            self.reserve.waiting.fetch_sub(1, Ordering::SeqCst);
        } else {
            // Granted under the lock before we got here (so the answer is in the channel):
            // give it back to where it came from.
            match granted.try_recv() {
                Ok(true) => self.budget.give_back_reserved(self.reserve, self.bytes),
                Ok(false) => {
                    if let Some(entry) = state.tenants.get(&self.tenant) {
                        entry.held.sub_shared(self.bytes);
                    }
                    self.budget.held.sub_shared(self.bytes);
                }
                Err(_) => {}
            }
        }
        if state
            .tenants
            .get(&self.tenant)
            .is_some_and(|t| t.waiters.is_empty())
        {
            state.ring.retain(|&t| t != self.tenant);
        }
        // A removed head may have blocked the round; freed bytes may let others through.
        self.budget.grant_waiting(state);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    const MIB: u64 = 1 << 20;

    /// Polls once: `Some` if the charge was granted (or failed) at once.
    fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        match future.poll(&mut cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        }
    }

    fn held(budget: &Budget) -> (u64, Vec<(Option<String>, u64)>) {
        let view = budget.view();
        let tenants = view
            .tenants
            .iter()
            .map(|t| (t.tenant.clone(), t.inflight_bytes))
            .collect();
        (view.inflight_bytes, tenants)
    }

    #[test]
    fn charges_fit_under_both_bounds_and_come_back_on_drop() {
        let budget = Budget::new(64 * MIB, 96 * MIB);
        let a = budget.join(Some("a"));
        let none = budget.join(None);
        let c1 = poll_once(pin!(a.charge(32 * MIB))).unwrap().unwrap();
        let c2 = poll_once(pin!(a.charge(32 * MIB))).unwrap().unwrap();
        // Tenant a is at its bound: a third charge waits, even though the node has room.
        {
            let mut third = pin!(a.charge(MIB));
            assert!(poll_once(third.as_mut()).is_none());
            // Another tenant is not held up by a's waiting charge, nor sent to the line.
            let c3 = poll_once(pin!(none.charge(16 * MIB))).unwrap().unwrap();
            assert_eq!(budget.view().waited_charges_total, 1);
            assert_eq!(held(&budget).0, 80 * MIB);
            drop(c1);
            // a's waiter got its MiB when c1 came back.
            assert!(poll_once(third.as_mut()).unwrap().is_ok());
            drop(c3);
        }
        assert_eq!(
            held(&budget).0,
            32 * MIB,
            "c2 only; the granted MiB was dropped"
        );
        drop(c2);
        assert_eq!(held(&budget).0, 0);
        assert_eq!(budget.view().peak_inflight_bytes, 80 * MIB);
    }

    /// The rule that serves a fresh connection next to connections of its own tenant that
    /// hold all the tenant's bytes and never give them back.
    #[test]
    fn a_session_is_served_from_its_reserve_while_its_tenant_is_full() {
        const KIB: u64 = 1 << 10;
        // 4 sessions with 1 MiB each out of a 100 MiB node: a shared pool of 96 MiB.
        let budget = Budget::with_reserve(64 * MIB, 100 * MIB, MIB, 4);
        assert_eq!(budget.view().shared_inflight_bytes, 96 * MIB);
        let hog1 = budget.join(None);
        let hog2 = budget.join(None);
        let fresh = budget.join(None);
        let other = budget.join(Some("b"));
        // Charges above a reserve come from the shared pool: two hogs fill their tenant.
        let held_by_hogs = [
            poll_once(pin!(hog1.charge(32 * MIB))).unwrap().unwrap(),
            poll_once(pin!(hog2.charge(32 * MIB))).unwrap().unwrap(),
        ];
        let mut hog_waits = Box::pin(hog1.charge(32 * MIB));
        assert!(poll_once(hog_waits.as_mut()).is_none());
        // The fresh session's 256 x 4 KiB are granted at once from its reserve, although its
        // tenant is full and a charge of the tenant waits.
        let mut small: Vec<Charge> = (0..256)
            .map(|_| poll_once(pin!(fresh.charge(4 * KIB))).unwrap().unwrap())
            .collect();
        let view = budget.view();
        assert_eq!(view.inflight_bytes, 65 * MIB);
        assert_eq!(view.reserved_inflight_bytes, MIB);
        assert_eq!(view.tenants[0].reserved_inflight_bytes, MIB);
        // Its reserve is full: the next one waits in the tenant's line, behind the hog ...
        let mut next = Box::pin(fresh.charge(4 * KIB));
        assert!(poll_once(next.as_mut()).is_none());
        let mut after = Box::pin(fresh.charge(4 * KIB));
        assert!(poll_once(after.as_mut()).is_none());
        // ... and is granted from the reserve as soon as one of its own comes back, while the
        // hog still waits for its tenant's bytes.
        drop(small.pop());
        let next = poll_once(next.as_mut()).unwrap().unwrap();
        assert!(poll_once(after.as_mut()).is_none());
        assert!(poll_once(hog_waits.as_mut()).is_none());
        // Granted from the reserve but dropped before it was polled: the bytes go back there.
        drop(small.pop());
        drop(after);
        assert_eq!(budget.view().reserved_inflight_bytes, MIB - 4 * KIB);
        // Another tenant still has the rest of the shared pool; nobody has more.
        let b = poll_once(pin!(other.charge(32 * MIB))).unwrap().unwrap();
        assert!(budget.view().inflight_bytes <= 100 * MIB);
        let mut b_waits = Box::pin(other.charge(2 * MIB));
        assert!(
            poll_once(b_waits.as_mut()).is_none(),
            "the shared pool is full"
        );
        // A session's reserve is its own: the fresh session's free 4 KiB is not the hog's.
        let mut hog_small = Box::pin(hog2.charge(4 * KIB));
        assert!(
            poll_once(hog_small.as_mut()).unwrap().is_ok(),
            "hog2 has its own reserve"
        );
        drop(held_by_hogs);
        assert!(poll_once(hog_waits.as_mut()).unwrap().is_ok());
        assert!(poll_once(b_waits.as_mut()).unwrap().is_ok());
        drop((small, next, hog_small, hog_waits, b_waits, b));
        let view = budget.view();
        assert_eq!((view.inflight_bytes, view.reserved_inflight_bytes), (0, 0));
        assert_eq!(view.peak_inflight_bytes, 97 * MIB);
        assert_eq!(fresh.reserved_bytes(), 0);
    }

    #[test]
    fn the_reserves_together_never_pass_their_share_of_the_node() {
        // Reserves for 2 sessions: a third session (one that outlives its admission slot) has
        // none left and goes to the shared pool.
        let budget = Budget::with_reserve(8 * MIB, 16 * MIB, MIB, 2);
        let sessions = [budget.join(None), budget.join(None), budget.join(None)];
        let held: Vec<Charge> = sessions
            .iter()
            .map(|s| poll_once(pin!(s.charge(MIB))).unwrap().unwrap())
            .collect();
        let view = budget.view();
        assert_eq!(view.reserved_inflight_bytes, 2 * MIB);
        assert_eq!(view.inflight_bytes, 3 * MIB);
        assert_eq!(view.shared_inflight_bytes, 14 * MIB);
        drop(held);
        assert_eq!(budget.view().inflight_bytes, 0);
    }

    #[test]
    fn a_charge_larger_than_the_tenant_budget_is_refused() {
        let budget = Budget::new(8 * MIB, 16 * MIB);
        let a = budget.join(None);
        let out = poll_once(pin!(a.charge(9 * MIB))).unwrap();
        assert!(matches!(out, Err(BudgetError::TooLarge { .. })));
    }

    #[test]
    fn waiting_charges_are_granted_round_robin_over_tenants() {
        let budget = Budget::new(64 * MIB, 64 * MIB);
        let hog = budget.join(Some("hog"));
        let other = budget.join(Some("other"));
        let full = poll_once(pin!(hog.charge(64 * MIB))).unwrap().unwrap();
        // Two hog charges wait, then one of the other tenant; only two of the three fit in
        // the node once `full` comes back.
        let mut h1 = Box::pin(hog.charge(32 * MIB));
        let mut h2 = Box::pin(hog.charge(32 * MIB));
        let mut o1 = Box::pin(other.charge(32 * MIB));
        assert!(poll_once(h1.as_mut()).is_none());
        assert!(poll_once(h2.as_mut()).is_none());
        assert!(poll_once(o1.as_mut()).is_none());
        drop(full);
        // The other tenant gets its turn before the hog's second charge, and the hog's come
        // in their order.
        let o1 = poll_once(o1.as_mut()).unwrap().unwrap();
        let h1 = poll_once(h1.as_mut()).unwrap().unwrap();
        assert!(poll_once(h2.as_mut()).is_none());
        drop(o1);
        assert!(poll_once(h2.as_mut()).unwrap().is_ok());
        drop(h1);
        assert_eq!(held(&budget).0, 0);
        assert_eq!(budget.view().waited_charges_total, 3);
    }

    #[test]
    fn a_large_waiting_charge_is_not_passed_by_small_ones() {
        let budget = Budget::new(64 * MIB, 64 * MIB);
        let a = budget.join(Some("a"));
        let b = budget.join(Some("b"));
        let held_by_a = poll_once(pin!(a.charge(40 * MIB))).unwrap().unwrap();
        // b wants 32 MiB: only 24 are free, so it waits first in line ...
        let mut big = Box::pin(b.charge(32 * MIB));
        assert!(poll_once(big.as_mut()).is_none());
        // ... and a small charge of a, which would fit, waits behind it.
        let mut small = Box::pin(a.charge(MIB));
        assert!(poll_once(small.as_mut()).is_none());
        drop(held_by_a);
        let big = poll_once(big.as_mut()).unwrap().unwrap();
        let small = poll_once(small.as_mut()).unwrap().unwrap();
        assert_eq!(held(&budget).0, 33 * MIB);
        drop((big, small));
    }

    #[test]
    fn a_dropped_waiter_leaves_the_line_and_a_granted_one_gives_back() {
        let budget = Budget::new(64 * MIB, 64 * MIB);
        let a = budget.join(Some("a"));
        let b = budget.join(Some("b"));
        let held_by_a = poll_once(pin!(a.charge(60 * MIB))).unwrap().unwrap();
        let mut big = Box::pin(b.charge(32 * MIB));
        assert!(poll_once(big.as_mut()).is_none());
        let mut small = Box::pin(a.charge(MIB));
        assert!(poll_once(small.as_mut()).is_none());
        // The blocking head goes away: the small one behind it fits at once.
        drop(big);
        assert!(poll_once(small.as_mut()).unwrap().is_ok());
        assert_eq!(
            held(&budget).0,
            60 * MIB,
            "the granted MiB was dropped with its future"
        );
        // Granted but never polled again: dropping the future gives the bytes back.
        let mut waiting = Box::pin(b.charge(8 * MIB));
        assert!(poll_once(waiting.as_mut()).is_none());
        drop(held_by_a);
        assert_eq!(held(&budget).0, 8 * MIB, "granted to the waiter");
        drop(waiting);
        assert_eq!(held(&budget).0, 0);
    }

    /// At rest (between calls), the ring's first tenant whose next charge fits its own bound
    /// waits for the node: nothing that could be granted is left waiting, and a waiting charge
    /// was passed only by charges of tenants ahead of it or when it did not fit.
    fn check_at_rest(budget: &Budget) {
        let state = budget.lock();
        let mut sum = 0;
        let mut reserved_sum = 0;
        let node_reserved = budget.held.reserved();
        for entry in state.tenants.values() {
            assert!(entry.held.shared() <= budget.per_tenant_bytes);
            sum += entry.held.shared();
            reserved_sum += entry.held.reserved();
            for waiter in &entry.waiters {
                let session = waiter.session.held_bytes.load(Ordering::SeqCst);
                assert!(session <= budget.reserved_per_session_bytes);
                assert!(
                    !(session + waiter.bytes <= budget.reserved_per_session_bytes
                        && node_reserved + waiter.bytes <= budget.reserve_bytes),
                    "a charge that fits its session's reserve was left waiting"
                );
            }
            assert_eq!(
                entry
                    .waiters
                    .iter()
                    .map(|w| w.session.waiting.load(Ordering::SeqCst))
                    .max()
                    .unwrap_or(0),
                entry
                    .waiters
                    .iter()
                    .map(|w| entry
                        .waiters
                        .iter()
                        .filter(|v| Arc::ptr_eq(&v.session, &w.session))
                        .count())
                    .max()
                    .unwrap_or(0),
                "a session's count of waiting charges is off"
            );
            assert_eq!(
                state
                    .ring
                    .iter()
                    .filter(|&&t| state.tenants[&t].name == entry.name)
                    .count(),
                usize::from(!entry.waiters.is_empty()),
                "a tenant is in the ring exactly when it has waiting charges"
            );
        }
        let node_shared = budget.held.shared();
        assert_eq!(sum, node_shared);
        assert_eq!(reserved_sum, node_reserved);
        assert!(node_shared <= budget.shared_bytes());
        assert!(node_reserved <= budget.reserve_bytes);
        assert!(node_shared + node_reserved <= budget.per_node_bytes);
        let first_eligible = state.ring.iter().find_map(|t| {
            let entry = &state.tenants[t];
            let head = entry.waiters.front()?.bytes;
            (entry.held.shared() + head <= budget.per_tenant_bytes).then_some(head)
        });
        if let Some(head) = first_eligible {
            assert!(
                node_shared + head > budget.shared_bytes(),
                "a charge that fits was left waiting"
            );
        }
    }

    proptest::proptest! {
        /// Any sequence of charges and releases by three tenants keeps both bounds, leaves
        /// nothing grantable waiting, and once everything is given back every waiting charge
        /// is granted.
        #[test]
        fn bounds_hold_and_every_waiting_charge_is_granted(
            ops in proptest::collection::vec((0usize..5, 1u64..=80, proptest::bool::ANY), 1..200)
        ) {
            // Sizes in half MiB, with 1 MiB reserved for each of five sessions (two of "a").
            const UNIT: u64 = MIB / 2;
            let budget = Budget::with_reserve(64 * MIB, 100 * MIB, MIB, 5);
            let accounts = [
                budget.join(Some("a")),
                budget.join(Some("b")),
                budget.join(None),
                budget.join(Some("a")),
                budget.join(None),
            ];
            let mut pending = Vec::new();
            let mut granted: Vec<Charge> = Vec::new();
            for (tenant, mib, release) in ops {
                if release && !granted.is_empty() {
                    let index = usize::try_from(mib).unwrap() % granted.len();
                    drop(granted.swap_remove(index));
                } else {
                    pending.push(Box::pin(accounts[tenant].charge(mib * UNIT)));
                }
                let mut still = Vec::new();
                for mut future in pending.drain(..) {
                    match poll_once(future.as_mut()) {
                        Some(charge) => granted.push(charge.unwrap()),
                        None => still.push(future),
                    }
                }
                pending = still;
                check_at_rest(&budget);
            }
            // Give everything back: each waiting charge is granted in turn.
            while !pending.is_empty() {
                granted.clear();
                let mut still = Vec::new();
                for mut future in pending.drain(..) {
                    match poll_once(future.as_mut()) {
                        Some(charge) => granted.push(charge.unwrap()),
                        None => still.push(future),
                    }
                }
                proptest::prop_assert!(!granted.is_empty(), "waiting charges left with nothing held");
                pending = still;
                check_at_rest(&budget);
            }
            drop(granted);
            proptest::prop_assert_eq!(budget.view().inflight_bytes, 0);
        }
    }

    /// Sessions on four threads charge while a fifth thread gives their charges back (as
    /// replies written elsewhere do): the reserves' lock-free takes and give-backs race the
    /// shared pool's locked ones, and still no bound is passed, every charge is granted, and
    /// everything comes back.
    #[test]
    fn racing_sessions_keep_the_bounds_and_give_everything_back() {
        const KIB: u64 = 1 << 10;
        const SESSIONS: usize = 4;
        // 64 KiB reserved per session (256 KiB in all) and a 256 KiB shared pool: a session
        // holding seven 16 KiB charges has 48 KiB of the pool, more than half of its
        // tenant's 80 KiB, so the two sessions of "a" wait for each other in the line.
        let budget = Budget::with_reserve(80 * KIB, 512 * KIB, 64 * KIB, SESSIONS);
        let (to_dropper, dropped) = std::sync::mpsc::channel::<Charge>();
        let dropper = std::thread::spawn(move || {
            for charge in dropped {
                drop(charge);
            }
        });
        let (done_tx, done) = std::sync::mpsc::channel();
        let sessions: Vec<_> = (0..SESSIONS)
            .map(|i| {
                let budget = Arc::clone(&budget);
                let to_dropper = to_dropper.clone();
                let done_tx = done_tx.clone();
                std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .build()
                        .unwrap();
                    runtime.block_on(async {
                        let account = budget.join((i % 2 == 0).then_some("a"));
                        let mut held = VecDeque::new();
                        for _ in 0..20_000 {
                            held.push_back(account.charge(16 * KIB).await.unwrap());
                            let total = budget.held.shared() + budget.held.reserved();
                            assert!(total <= 512 * KIB, "{total} bytes held");
                            assert!(budget.held.reserved() <= 256 * KIB);
                            if held.len() >= 7
                                && let Some(charge) = held.pop_front()
                            {
                                to_dropper.send(charge).unwrap();
                            }
                        }
                        drop(held);
                    });
                    done_tx.send(()).unwrap();
                })
            })
            .collect();
        drop(to_dropper);
        for _ in 0..SESSIONS {
            done.recv_timeout(std::time::Duration::from_secs(120))
                .expect("a session's charge was never granted");
        }
        for session in sessions {
            session.join().unwrap();
        }
        dropper.join().unwrap();
        let view = budget.view();
        assert_eq!((view.inflight_bytes, view.reserved_inflight_bytes), (0, 0));
        assert!(view.peak_inflight_bytes <= 512 * KIB);
        assert!(view.tenants.is_empty(), "{:?}", view.tenants);
        eprintln!("{} charges waited", view.waited_charges_total);
    }

    #[test]
    fn tenants_are_forgotten_when_unused() {
        let budget = Budget::new(8 * MIB, 16 * MIB);
        let a = budget.join(Some("a"));
        let charge = poll_once(pin!(a.charge(MIB))).unwrap().unwrap();
        drop(a);
        assert_eq!(budget.view().tenants.len(), 1, "still holds a charge");
        drop(charge);
        assert!(budget.view().tenants.is_empty());
    }
}
