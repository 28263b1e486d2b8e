//! The fuzz corpus of the `router` target (`fuzz/corpus/router`) replayed as an ordinary
//! test: each input goes through the same check function the fuzz target runs
//! (`fuzz/src/router.rs`, included below: requests through the real router of a real node on
//! the memory store, with the bootstrap, an admin and a read token). A missing or empty corpus
//! fails.

#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/src/router.rs"]
mod router;

use std::path::Path;

#[test]
fn router_corpus_replays() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    corpus::replay(&root, "router", router::check_router);
}

/// The seeds (one request per documented route, what the CLI sends) pass the checks, and each
/// decodes back to the request it was made from.
#[test]
fn cli_requests_pass_the_checks() {
    let seeds = router::router_seeds();
    assert!(seeds.len() >= 30, "one seed per documented route");
    for (name, input) in seeds {
        eprintln!("seed {name}");
        let decoded = router::RequestSpec::decode(&input);
        assert_eq!(decoded.len(), 1, "{name}");
        assert_eq!(decoded[0].encode(), input, "{name}");
        router::check_router(&input);
    }
}

/// Found by schemathesis (`crates/headroom/tests/schemathesis.rs`) and checked by the fuzzer
/// since: a path parameter that does not parse (`POST /v1/devices/-1/fail`, `GET
/// /v1/volumes/%FF`) got axum's plain-text 400, not the API's JSON error. The inputs are in
/// the corpus as `regression-*`, byte for byte; the check fails on a body that is not
/// `{"error", "kind"}`.
#[test]
fn regression_path_parameters_that_do_not_parse_get_a_json_error() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/router");
    let regressions = router::router_regressions();
    assert!(!regressions.is_empty());
    for (name, input) in regressions {
        let path = root.join(format!("regression-{name}"));
        let committed = std::fs::read(&path)
            .unwrap_or_else(|err| panic!("{} is missing: {err}", path.display()));
        assert_eq!(
            committed,
            input,
            "{} differs from its input",
            path.display()
        );
        router::check_router(&input);
    }
}
