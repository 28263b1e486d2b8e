//! Poison-tolerant lock helpers, the workspace's one copy (the node uses them too).
//!
//! Why: a panic in one worker thread must not turn every later I/O into a second panic
//! (`lock().unwrap()`), and the workspace forbids `unwrap`. Every critical section in this
//! crate (and in the node) leaves its data consistent at each step, so recovering the guard
//! is sound.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `m`'s guard, poisoned or not.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `l`'s read guard, poisoned or not.
pub fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// `l`'s write guard, poisoned or not.
pub fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}
