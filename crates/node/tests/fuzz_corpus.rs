//! The fuzz corpus of the `api_bodies` target (`fuzz/corpus/api_bodies`) replayed as an
//! ordinary test: each input goes through the same check function the fuzz target runs
//! (`fuzz/src/api.rs`, included below: axum's `Json` and `Query` decoding of the API's request
//! bodies, then name, tenant and QoS handling). A missing or empty corpus fails.

#[path = "../../../fuzz/src/api.rs"]
mod checks;
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;

use std::path::Path;

#[test]
fn api_bodies_corpus_replays() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    corpus::replay(&root, "api_bodies", checks::check_api_bodies);
}

/// The seeds (what the CLI sends) pass the checks too.
#[test]
fn cli_bodies_pass_the_checks() {
    let seeds = checks::api_seeds();
    assert!(!seeds.is_empty());
    for (name, body) in seeds {
        eprintln!("seed {name}");
        checks::check_api_bodies(&body);
    }
}

/// Found by `api_bodies` in a 30-million-execution run: `burst: none` over `baseline_iops: 0`
/// resolved to a fixed 0 IOPS, a volume whose every I/O waits forever (the fuzzer saw it as
/// the Wild policy holding the read for good and failing its work-conserving invariant). Now
/// refused like a `ceiling_iops` of 0. The input is also in the corpus
/// (`fuzz/corpus/api_bodies/regression-burst-none-zero-baseline`).
#[test]
fn regression_burst_none_over_a_zero_baseline_is_refused() {
    let body =
        br#"{"name":"L","size_bytes":1,"qos":{"baseline_iops":0,"burst":"none","weight":10000}}"#;
    checks::check_api_bodies(body);
    let spec = headroom_qos::QosSpec {
        baseline_iops: Some(0),
        burst: Some(headroom_qos::BurstKind::None),
        weight: Some(10_000),
        ..headroom_qos::QosSpec::default()
    };
    let Err(err) = headroom_node::volume_qos::StoredQos::resolve(spec, 1) else {
        panic!("a fixed rate of 0 IOPS resolved");
    };
    assert!(
        err.to_string().contains("burst none with baseline_iops 0"),
        "{err}"
    );
}
