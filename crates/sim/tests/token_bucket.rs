//! A single credit bucket driven through the shipped Credit policy matches its closed form:
//! a full bucket of `B` credits refilled at `r` and drained at `R > r` lasts `B / (R - r)`,
//! after which the volume runs at exactly `r` (gp2 semantics, docs/background.md §5.1).

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::{RunOptions, Scenario, run};

const SCENARIO: &str = r#"
    name = "bucket"
    duration_s = 20.0
    timeline_ms = 100.0
    [node]
    workers = 1
    [[groups]]
    name = "vol"
    qos = { baseline_iops = 100.0, ceiling_iops = 1000.0, burst = "credits", credit_iops = { capacity = 9000.0 } }
    workload = { mode = "open", rate_iops = 1000.0, arrival = "uniform", qd = 64, sizes = "4k" }
"#;

#[test]
fn credit_bucket_drains_at_the_closed_form_time_then_runs_at_refill() {
    let s = Scenario::from_toml_str(SCENARIO).unwrap();
    let r = run(
        &s,
        RunOptions {
            seed: 1,
            policies: vec!["credit".into()],
            ..RunOptions::default()
        },
    )
    .unwrap();
    let res = &r.results[0];
    let b = &res.series.groups[0].buckets;
    let bs = res.series.bucket_s;
    let rate = |i: usize| b[i].ops as f64 / bs;
    // Full rate while credits last: B / (R - r) = 9000 / 900 = 10 s.
    for i in 2..95 {
        assert!(
            (rate(i) - 1000.0).abs() <= 20.0,
            "t={:.1}s rate {}",
            i as f64 * bs,
            rate(i)
        );
    }
    // Then exactly the refill rate.
    for i in 110..200 {
        assert!(
            (rate(i) - 100.0).abs() <= 20.0,
            "t={:.1}s rate {}",
            i as f64 * bs,
            rate(i)
        );
    }
    let knee = (0..200).find(|&i| rate(i) < 550.0).unwrap() as f64 * bs;
    assert!(
        (knee - 10.0).abs() <= 0.2,
        "bucket emptied at {knee} s, closed form 10 s"
    );
    // Total served in 20 s: 9000 credits + 20 s x 100 refill = 11000 I/Os.
    let total: u64 = b.iter().map(|x| x.ops).sum();
    assert!((total as f64 - 11_000.0).abs() <= 110.0, "total {total}");
    // Above-baseline I/Os were paid with credits.
    let share = &res.details.groups[0].phase_share;
    assert!(share.burst_credit > 0.7, "credit share {share:?}");
}
