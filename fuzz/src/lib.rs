//! The checks of Headroom's fuzz targets and the seed inputs they start from.
//!
//! `nbd` and `api` are also included, file for file, by the main workspace's corpus replay
//! tests (`crates/nbd/tests/fuzz_corpus.rs`, `crates/node/tests/fuzz_corpus.rs`), `router` by
//! `crates/node/tests/fuzz_router_corpus.rs` and `session` by
//! `crates/node/tests/fuzz_session_corpus.rs`, so a corpus input is checked the same way under
//! the fuzzer and in CI.

pub mod api;
pub mod corpus;
pub mod nbd;
pub mod router;
pub mod session;
