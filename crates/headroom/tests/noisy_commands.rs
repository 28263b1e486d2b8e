//! The noisy-neighbour suite of commands without payload, short, on every CI run: a victim's
//! 4 KiB reads at queue depth 1 next to a volume that loops FLUSH after every write, FUA
//! writes, 32 MiB CACHE, BLOCK_STATUS over a fragmented volume, 256 MiB NO_HOLE
//! WRITE_ZEROES and 256 MiB TRIM (`scripts/bench-noisy-commands --rounds 1 --runtime 2`,
//! its own server, real fio).
//!
//! What it asserts is what holds on any machine: next to each neighbour the victim is
//! served (reads complete every phase, none waits in the server as long as a second: the
//! lockout this suite was written against kept a fresh client waiting past 10 s), and the
//! neighbour is served too (the node throttles, it does not starve). The latency target (a
//! victim p99 within 1.5× alone) is a timing ratio that a loaded 2-core CI machine cannot
//! hold steady; the test prints the numbers, and docs/results.md has the runs on an idle
//! machine and the charges behind them, which the node's unit tests assert in process
//! (`a_request_is_charged_every_sync_it_causes`,
//! `a_split_request_holds_at_most_two_pieces_in_the_node_and_answers_once`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

/// No read of the victim may wait this long in the server next to any neighbour.
const LOCKOUT_US: f64 = 1_000_000.0;

#[test]
fn the_victim_and_every_noisy_command_are_served() {
    if !["fio", "python3"].iter().all(|t| common::have_tool(t)) {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let json = scratch.path().join("noisy.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-noisy-commands");
    let out = Command::new(&script)
        .args(["--rounds", "1", "--runtime", "2", "--json"])
        .arg(&json)
        .arg("--headroom")
        .arg(common::BIN)
        .env("TMPDIR", scratch.path())
        .output()
        .expect("run scripts/bench-noisy-commands");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    common::report(&format!("noisy-neighbour suite (short):\n{stdout}"));
    assert!(
        out.status.success(),
        "the suite failed:\n{stdout}\n{stderr}"
    );
    let rows: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let rows = rows.as_object().unwrap();
    let neighbours = [
        "flush-after-write",
        "fua-write",
        "cache",
        "block-status",
        "write-zeroes",
        "trim",
    ];
    for kind in std::iter::once("alone").chain(neighbours) {
        let row = &rows[kind];
        let number = |key: &str| row[key].as_f64().unwrap_or(f64::NAN);
        assert!(
            number("victim_iops") > 0.0,
            "{kind}: the victim got nothing done: {row}"
        );
        let server_p99 = number("server_p99_us");
        assert!(
            server_p99 < LOCKOUT_US,
            "{kind}: a victim read waited {server_p99} us in the server: {row}"
        );
        if kind != "alone" {
            assert!(
                number("neighbour_rps") > 0.0,
                "{kind}: the neighbour got nothing done: {row}"
            );
        }
    }
}
