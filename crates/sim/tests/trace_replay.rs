//! Trace replay end to end: every record becomes one I/O at its recorded time.

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::{RunOptions, Scenario, run};

#[test]
fn alibaba_trace_replays_every_record_per_device() {
    let dir = std::env::temp_dir().join(format!("headroom-sim-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut text = String::new();
    // device 7: 100 reads 10 ms apart; device 9: 50 writes 20 ms apart (1 s total).
    let t0 = 1_577_808_000_000_000u64;
    for i in 0..100u64 {
        text.push_str(&format!("7,R,{},4096,{}\n", i * 4096, t0 + i * 10_000));
    }
    for i in 0..50u64 {
        text.push_str(&format!("9,W,{},8192,{}\n", i * 8192, t0 + i * 20_000));
    }
    std::fs::write(dir.join("t.csv"), text).unwrap();
    let scenario = r#"
        name = "trace"
        duration_s = 2.0
        [node]
        workers = 1
        [[groups]]
        name = "replay"
        tenants = 0
        workload = { mode = "trace", trace = { path = "t.csv", format = "alibaba" } }
    "#;
    let path = dir.join("s.toml");
    std::fs::write(&path, scenario).unwrap();
    let s = Scenario::load(&path).unwrap();
    let r = run(
        &s,
        RunOptions {
            seed: 1,
            policies: vec!["fifo".into()],
            ..RunOptions::default()
        },
    )
    .unwrap();
    let res = &r.results[0];
    let tenants = &res.series.tenants;
    assert_eq!(tenants.len(), 2);
    assert_eq!(tenants[0].ops, 100);
    assert_eq!(tenants[1].ops, 50);
    assert_eq!(tenants[1].bytes, 50 * 8192);
    // Spread over ~1 s: the first 100 ms bucket holds ~10 reads and ~5 writes, not all.
    let first = res.series.groups[0].buckets[0].ops;
    assert!((10..=20).contains(&first), "first bucket {first}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_trace_fails_with_line_number() {
    let dir = std::env::temp_dir().join(format!("headroom-sim-badtrace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("bad.csv"), "7,R,0,4096,100\n7,Q,0,4096,200\n").unwrap();
    let scenario = r#"
        name = "bad"
        duration_s = 1.0
        [[groups]]
        name = "replay"
        workload = { mode = "trace", trace = { path = "bad.csv", format = "alibaba" } }
    "#;
    let path = dir.join("s.toml");
    std::fs::write(&path, scenario).unwrap();
    let s = Scenario::load(&path).unwrap();
    let err = run(
        &s,
        RunOptions {
            policies: vec!["fifo".into()],
            ..RunOptions::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("bad.csv:2:"), "{err}");
    assert!(err.contains("opcode"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
