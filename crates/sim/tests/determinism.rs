//! Same seed, same report; different seed, different report; failures name their seed.

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::{RunOptions, Scenario, SimError, run};

const SCENARIO: &str = r#"
    name = "det"
    duration_s = 0.5
    warmup_s = 0.1
    [node]
    workers = 3
    dispatch = "one_to_n"
    [[groups]]
    name = "victim"
    tenants = 5
    qos = { baseline_iops = 5000.0, ceiling_iops = 20000.0, burst = "on_demand" }
    workload = { mode = "open", rate_iops = 3000.0, sizes = "iops" }
    [[groups]]
    name = "burster"
    tenants = 3
    queues = 4
    hot_queue_share = 0.8
    qos = { baseline_iops = 5000.0, ceiling_iops = 100000.0, burst = "on_demand" }
    workload = { mode = "closed", qd = 16, sizes = "bps", onoff = { on_s = 0.1, off_s = 0.05 } }
"#;

fn json(seed: u64, policies: &[&str]) -> String {
    let s = Scenario::from_toml_str(SCENARIO).unwrap();
    let r = run(
        &s,
        RunOptions {
            seed,
            policies: policies.iter().map(|p| p.to_string()).collect(),
            ..RunOptions::default()
        },
    )
    .unwrap();
    serde_json::to_string(&r).unwrap()
}

#[test]
fn same_seed_same_report() {
    for policy in ["fifo", "wild", "base", "burst"] {
        let a = json(42, &[policy]);
        let b = json(42, &[policy]);
        assert_eq!(a, b, "policy {policy} is not deterministic");
    }
}

#[test]
fn different_seed_different_report() {
    assert_ne!(json(1, &["fifo"]), json(2, &["fifo"]));
}

#[test]
fn report_has_the_issue_shape() {
    let v: serde_json::Value = serde_json::from_str(&json(7, &["fifo", "wild"])).unwrap();
    assert_eq!(v["scenario"], "det");
    assert_eq!(v["seed"], 7);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["policy"], "fifo");
    let groups = results[1]["groups"].as_array().unwrap();
    let names: Vec<&str> = groups.iter().map(|g| g["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["victim", "burster"]);
    for g in groups {
        let mut keys: Vec<&str> = g.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        keys.sort_unstable();
        let mut want = [
            "name",
            "iops",
            "bytes_per_s",
            "lat_mean_us",
            "lat_p50_us",
            "lat_p99_us",
            "lat_p999_us",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        assert!(g["iops"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn unknown_policy_is_an_error() {
    let s = Scenario::from_toml_str(SCENARIO).unwrap();
    let err = run(
        &s,
        RunOptions {
            policies: vec!["turbo".into()],
            ..RunOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, SimError::UnknownPolicy(_)));
}

#[test]
fn failing_run_names_its_seed() {
    // A trace file that does not exist fails at build time; the error carries the seed.
    let text = SCENARIO.replace(
        r#"workload = { mode = "open", rate_iops = 3000.0, sizes = "iops" }"#,
        r#"workload = { mode = "trace", trace = { path = "/nonexistent.csv", format = "msr" } }"#,
    );
    let s = Scenario::from_toml_str(&text).unwrap();
    let err = run(
        &s,
        RunOptions {
            seed: 987654,
            policies: vec!["fifo".into()],
            ..RunOptions::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("seed 987654"), "{err}");
}

#[test]
fn outputs_are_written() {
    let dir = std::env::temp_dir().join(format!("headroom-sim-out-{}", std::process::id()));
    let s = Scenario::from_toml_str(SCENARIO).unwrap();
    let mut fractions = Vec::new();
    let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let seen2 = seen.clone();
    run(
        &s,
        RunOptions {
            seed: 3,
            policies: vec!["fifo".into()],
            out_dir: Some(dir.clone()),
            progress: Some(Box::new(move |f| seen2.borrow_mut().push(f))),
        },
    )
    .unwrap();
    fractions.extend(seen.borrow().iter().copied());
    for f in [
        "report.json",
        "groups.csv",
        "timeline.csv",
        "phases.csv",
        "tenants.csv",
        "workers.csv",
        "latency_cdf_fifo.svg",
        "throughput_fifo.svg",
        "phases_fifo.svg",
    ] {
        let p = dir.join(f);
        let meta = std::fs::metadata(&p).unwrap_or_else(|_| panic!("{} missing", p.display()));
        assert!(meta.len() > 0, "{f} is empty");
    }
    assert_eq!(fractions.last().copied(), Some(1.0));
    assert!(fractions.windows(2).all(|w| w[1] >= w[0]));
    let _ = std::fs::remove_dir_all(&dir);
}
