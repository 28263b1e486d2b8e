//! Every scenario shipped in `scenarios/` parses, and reproduction (a)'s file has the shape
//! the CLI and the issue rely on (groups `victim` and `burster`, policies wild/base/burst).

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::{RunOptions, Scenario, run};
use std::path::PathBuf;

fn scenarios_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

#[test]
fn every_shipped_scenario_parses() {
    let mut n = 0;
    for entry in std::fs::read_dir(scenarios_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let s = Scenario::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!s.name().is_empty());
        assert!(!s.default_policies().is_empty());
        n += 1;
    }
    assert!(n >= 10, "expected the reproduction scenarios, found {n}");
}

#[test]
fn burstcbs_victims_runs_under_wild_base_and_burst() {
    let path = scenarios_dir().join("burstcbs-victims.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    // Same scenario, 60 ms of simulated time, so the test stays fast in the dev profile.
    let short = text
        .replace("duration_s = 3.0", "duration_s = 0.06")
        .replace("warmup_s = 0.5", "warmup_s = 0.02");
    assert_ne!(short, text, "the duration line moved; update this test");
    let s = Scenario::from_toml_str(&short).unwrap();
    assert_eq!(s.name(), "burstcbs-victims");
    assert_eq!(s.default_policies(), vec!["wild", "base", "burst"]);
    let r = run(
        &s,
        RunOptions {
            seed: 1,
            ..RunOptions::default()
        },
    )
    .unwrap();
    let policies: Vec<&str> = r.results.iter().map(|p| p.policy.as_str()).collect();
    assert_eq!(policies, ["wild", "base", "burst"]);
    for p in &r.results {
        let names: Vec<&str> = p.groups.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["victim", "burster"]);
        assert!(
            p.groups[0].iops > 30_000.0,
            "{}: victims {}",
            p.policy,
            p.groups[0].iops
        );
    }
}
