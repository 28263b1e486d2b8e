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
