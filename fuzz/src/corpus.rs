//! Corpus replay for the main workspace's tests: runs a target's check on every file of its
//! committed corpus, and refuses to pass on a missing or empty corpus (so a replay test can
//! never pass by not running).

use std::io::Write;
use std::path::Path;

/// Runs `check` on every file in `corpus_root/<target>/` and returns how many it ran.
///
/// Panics if the directory is missing, unreadable or holds no file, and (through `check`) on
/// the first input that breaks an invariant, naming the file first.
pub fn replay(corpus_root: &Path, target: &str, check: fn(&[u8])) -> usize {
    let dir = corpus_root.join(target);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) => panic!("corpus {} is missing: {err}", dir.display()),
    };
    let mut files: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    for path in &files {
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(err) => panic!("cannot read {}: {err}", path.display()),
        };
        // Captured: shown only when the check fails, naming the input.
        eprintln!("replaying {}", path.display());
        check(&bytes);
    }
    // Straight to stderr, past the test harness's capture, so every `cargo test` run shows it.
    let _ = writeln!(
        std::io::stderr(),
        "fuzz corpus {target}: replayed {} inputs from {}",
        files.len(),
        dir.display()
    );
    files.len()
}
