//! Errors of the QoS layer.
//!
//! One error type for everything a caller can get wrong (a malformed preset, an inconsistent
//! QoS, invalid policy parameters); invariant violations are a separate type because they mean
//! a bug in this crate, not bad input.

use thiserror::Error;

/// Bad input to the QoS layer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QosError {
    /// A preset string could not be parsed.
    #[error("invalid preset {preset:?}: {reason}")]
    InvalidPreset {
        /// The offending text.
        preset: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A volume QoS is internally inconsistent.
    #[error("invalid QoS: {0}")]
    InvalidQos(String),
    /// Policy parameters are out of range.
    #[error("invalid policy parameters: {0}")]
    InvalidParams(String),
    /// A policy name is unknown.
    #[error("unknown policy {0:?} (expected wild, base, credit, burst, mclock or drr-vop)")]
    UnknownPolicy(String),
    /// A preview request is out of range.
    #[error("invalid preview request: {0}")]
    InvalidPreview(String),
}

/// A broken scheduler invariant (a bug, reported by `Policy::check_invariants`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{policy}: invariant {invariant} violated: {detail}")]
pub struct InvariantViolation {
    /// Name of the policy that broke it.
    pub policy: &'static str,
    /// Short name of the invariant (`capacity`, `ceiling`, `credit_range`, `baseline`, `work_conserving`, `accounting`).
    pub invariant: &'static str,
    /// Human-readable detail with the numbers involved.
    pub detail: String,
}
