//! The fuzz corpus of the `session` target (`fuzz/corpus/session`) replayed as an ordinary
//! test: each input is one connection to the node's real NBD session over an in-memory pipe,
//! checked by the same function the fuzz target runs (`fuzz/src/session.rs`, included below:
//! no panic, no hang, every server byte a well-framed NBD reply to what the client sent, and
//! no tenant sees another's volume). Inputs in TLS mode need the `tls` feature (the CI test
//! build has it: `--features headroom/tls` turns on `headroom-node/tls`); without it they are
//! skipped and the plaintext ones still run. A missing or empty corpus fails.

#[path = "../../../fuzz/src/session.rs"]
mod checks;
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;

use std::path::Path;

#[test]
fn session_corpus_replays() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    corpus::replay(&root, "session", checks::check_session);
}

/// The seeds (real clients' conversations, encoded) pass the checks too.
#[test]
fn seed_conversations_pass_the_checks() {
    let seeds = checks::session_seeds();
    assert!(!seeds.is_empty());
    for (name, input) in seeds {
        eprintln!("seed {name}");
        checks::check_session(&input);
    }
}
