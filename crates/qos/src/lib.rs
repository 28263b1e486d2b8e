//! headroom-qos: the QoS core of Headroom.
//!
//! A pure, synchronous library: cost vectors, credit buckets, the scheduling policies and their
//! invariants. It never reads a clock, sleeps, spawns or does I/O; time is an argument
//! (`now_ns`). The server and the simulator call the same code (docs/design.md principle 1).
//!
//! Map:
//! - [`arbitration`]: how the arbiter splits a shared backend between nodes;
//! - [`vocab`]: what a volume was sold ([`VolumeQos`]), what a node can do ([`NodeCapacity`]),
//!   requests, phases and decisions;
//! - [`cost`]: the four-dimensional [`CostVector`];
//! - [`model`]: the [`CostModel`] (VOP curve, IOCost linear model, CPU model, online correction);
//! - [`bucket`] and [`limiter`]: exact token buckets, rate limiters, credit buckets, the pacer;
//! - [`policy`]: the [`Policy`] trait, [`PolicyKind`], [`PolicyParams`], [`build_policy`];
//! - [`presets`]: gp2, gp3, io2, Azure, AutoPL and QEMU/libvirt `iotune` classes;
//! - [`preview`](mod@preview): how a class answers a steady demand over time (`headroom qos preview`);
//! - [`routing`]: which replica serves a read, and whether an I/O continues a stream (FAST);
//! - [`spec`]: what an operator types ([`QosSpec`]: a preset refined by a few numbers),
//!   resolved against a volume size into a [`VolumeQos`].

pub mod arbitration;
pub mod bucket;
pub mod burst_gate;
pub mod cost;
pub mod cpu;
mod engine;
pub mod error;
pub mod global_pool;
pub mod limiter;
pub mod model;
mod policies;
pub mod policy;
pub mod presets;
pub mod preview;
pub mod rng;
pub mod routing;
mod sched;
pub mod spec;
mod tracker;
pub mod vocab;
mod wheel;

pub use cost::{CostVector, DIMENSIONS, Dimension};
pub use error::{InvariantViolation, QosError};
pub use model::CostModel;
pub use policy::{Policy, PolicyKind, PolicyParams, VolumeSnapshot, build_policy};
pub use presets::Preset;
pub use preview::{PreviewRequest, PreviewRow, preview};
pub use spec::{BurstKind, QosSpec};
pub use vocab::{
    BurstMode, CreditBucketSpec, CreditSpec, Decision, IoRate, IoRequest, NS_PER_S, NodeCapacity,
    Observed, OpKind, Phase, VolumeId, VolumeQos,
};

/// Hooks for the criterion benchmark and the overhead-count example only; not a stable API.
/// Compiled only with the `bench-support` feature (see `Cargo.toml`).
#[cfg(feature = "bench-support")]
#[doc(hidden)]
pub mod bench_support;
