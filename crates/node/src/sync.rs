//! Poison-tolerant lock helpers, the node's one copy.
//!
//! Why: a panic on one thread (a connection's task, an executor worker) must not turn every
//! later request into a second panic (`lock().unwrap()`), and the workspace forbids `unwrap`.
//! The node's critical sections leave their data consistent at each step (counters, queues,
//! maps updated in one place), so taking the guard of a poisoned lock is sound. The store has
//! the same rule in `headroom_store`'s own `sync` module: each crate states it once.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `m`'s guard, poisoned or not.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `l`'s read guard, poisoned or not.
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// `l`'s write guard, poisoned or not.
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}
