//! The fuzz corpora of the NBD targets (`fuzz/corpus/{handshake,option,request}`) replayed as
//! ordinary tests: each input goes through the same check function the fuzz target runs
//! (`fuzz/src/nbd.rs`, included below), so an input that once found a bug keeps guarding
//! against it in every `cargo test`, without cargo-fuzz. A missing or empty corpus fails.

#[path = "../../../fuzz/src/nbd.rs"]
mod checks;
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;

use std::path::{Path, PathBuf};

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
}

#[test]
fn handshake_corpus_replays() {
    corpus::replay(&corpus_root(), "handshake", checks::check_handshake);
}

#[test]
fn option_corpus_replays() {
    corpus::replay(&corpus_root(), "option", checks::check_option);
}

#[test]
fn request_corpus_replays() {
    corpus::replay(&corpus_root(), "request", checks::check_request);
}

/// The seeds built with the encoders pass the checks too (they are what the corpora grew from).
#[test]
fn encoder_built_seeds_pass_the_checks() {
    let check_all = |seeds: Vec<(&str, Vec<u8>)>, check: fn(&[u8])| {
        assert!(!seeds.is_empty());
        for (name, bytes) in seeds {
            eprintln!("seed {name}");
            check(&bytes);
        }
    };
    check_all(checks::handshake_seeds(), checks::check_handshake);
    check_all(checks::option_seeds(), checks::check_option);
    check_all(checks::request_seeds(), checks::check_request);
}
