//! Same seed, same report; different seed, different report; failures name their seed; and
//! one run's report matches a pinned digest, so that a change in results across versions is
//! seen (`PINNED_DIGEST`, just below the imports).

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::{RunOptions, Scenario, SimError, run};
use std::path::PathBuf;

/// FNV-1a (64-bit) digest of [`pinned_report_text`], as the simulator and the policies gave
/// it when this value was last set. A change in any result of that run (even one I/O or one
/// event more) changes it. The QoS policies and
/// the simulator both feed it, so a deliberate change to either updates this constant, with
/// the before/after numbers recorded in docs/results.md.
const PINNED_DIGEST: u64 = 0x7ff9_2cd0_745b_759f;

/// The run the digest covers: `scenarios/burstcbs-victims.toml` (reproduction (a): 4 victims
/// and 8 BPS bursters on 3 workers, one-to-N dispatch) under its own policies wild, base and
/// burst, shortened to 0.2 s with 0.05 s of warm-up so that it stays fast in the dev profile.
const PINNED_SEED: u64 = 1;

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

/// FNV-1a, 64 bits: a stable hash, unlike std's `DefaultHasher` whose algorithm may change
/// between Rust versions.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A float with fixed decimals: the text depends only on the value, not on the shortest
/// round-trip formatting of a serializer version.
fn fixed(x: f64) -> String {
    format!("{x:.6}")
}

/// Canonical text of a JSON value: object keys sorted, integers as they are, other numbers
/// through [`fixed`].
fn canonical(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => out.push_str(&u.to_string()),
            (None, Some(i)) => out.push_str(&i.to_string()),
            _ => out.push_str(&fixed(n.as_f64().unwrap())),
        },
        Value::String(s) => out.push_str(&serde_json::to_string(s).unwrap()),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_unstable();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push(':');
                canonical(&m[k.as_str()], out);
            }
            out.push('}');
        }
    }
}

/// The report of the pinned run as text: the JSON the CLI prints (canonicalised), then the
/// per-tenant numbers and time series that the JSON leaves out (the CSV files' data).
fn pinned_report_text() -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scenarios/burstcbs-victims.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let short = text
        .replace("duration_s = 3.0", "duration_s = 0.2")
        .replace("warmup_s = 0.5", "warmup_s = 0.05");
    assert_ne!(short, text, "the duration line moved; update this test");
    let s = Scenario::from_toml_str(&short).unwrap();
    let r = run(
        &s,
        RunOptions {
            seed: PINNED_SEED,
            ..RunOptions::default()
        },
    )
    .unwrap();
    let mut out = String::new();
    canonical(&serde_json::to_value(&r).unwrap(), &mut out);
    for p in &r.results {
        out.push_str(&format!(
            "\n{} bucket_s={}",
            p.policy,
            fixed(p.series.bucket_s)
        ));
        for t in &p.series.tenants {
            out.push_str(&format!(
                "\ntenant g{} ops={} bytes={} issued={} dropped={} lat_mean_us={} device_ns={}",
                t.group,
                t.ops,
                t.bytes,
                t.issued,
                t.dropped,
                fixed(t.lat_mean_us),
                fixed(t.device_ns)
            ));
        }
        for g in &p.series.groups {
            out.push_str(&format!("\ntimeline {}", g.name));
            for b in &g.buckets {
                out.push_str(&format!(" {}/{}/{}", b.ops, b.bytes, b.lat_sum_ns));
            }
        }
        out.push_str("\nphases");
        for ph in &p.series.phases {
            out.push_str(&format!(" {}/{}/{}", ph[0], ph[1], ph[2]));
        }
    }
    out
}

#[test]
fn pinned_scenario_digest_is_unchanged() {
    let digest = fnv1a64(pinned_report_text().as_bytes());
    assert!(
        digest == PINNED_DIGEST,
        "digest of burstcbs-victims (0.2 s, seed {PINNED_SEED}) is {digest:#018x}, pinned \
         {PINNED_DIGEST:#018x}: results changed: if intended, update PINNED_DIGEST and record \
         the before/after in docs/results.md"
    );
}
