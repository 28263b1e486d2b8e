//! The node's poison-tolerant locks: the store's helpers (`headroom_store::sync`), one copy
//! for the workspace.
//!
//! Why: a panic on one thread (a connection's task, an executor worker) must not turn every
//! later request into a second panic (`lock().unwrap()`), and the workspace forbids `unwrap`.
//! The node's critical sections leave their data consistent at each step (counters, queues,
//! maps updated in one place), so taking the guard of a poisoned lock is sound.

pub(crate) use headroom_store::sync::{lock, read, write};
