//! Mirror rebuilds of replaced volumes (`rebuild` on a `replace_volumes` action): the copy
//! moves exactly the volume, goes through the volumes' QoS, costs the tenant IOPS, and keeps
//! the old volume provisioned until it is done.

// Test helpers outside #[test] fns: a panic with the error is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use headroom_sim::report::GroupDetails;
use headroom_sim::{RebuildDetails, RunOptions, Scenario, SimReport, run};

const GIB: f64 = 1_073_741_824.0;

/// One tenant on one worker whose volume is replaced at `at_s`; `qos`, `workload` and
/// `action_extra` are TOML inline-table bodies / extra action lines.
fn scenario(volume_gib: f64, qos: &str, workload: &str, action_extra: &str) -> String {
    format!(
        r#"
        name = "rebuild"
        duration_s = 30.0
        warmup_s = 0.0
        policies = ["credit"]
        timeline_ms = 1000.0
        [node]
        workers = 1
        nic = {{ ingress_bytes_per_s = 0.0, egress_bytes_per_s = 0.0 }}
        cpu = {{ read_base_ns = 300.0, read_per_kib_ns = 0.0, write_base_ns = 300.0, write_per_kib_ns = 0.0 }}
        [[node.devices]]
        profile = "ssd_fast"
        latency_ns = 80000
        [[groups]]
        name = "t"
        volume_gib = {volume_gib}
        qos = {{ {qos} }}
        workload = {{ {workload} }}
        stats_from_s = 10.0
        stats_to_s = 20.0
        [[actions]]
        at_s = 10.0
        group = "t"
        replace_volumes = true
        {action_extra}
        "#
    )
}

const IDLE: &str = r#"mode = "idle""#;
const BUSY: &str = r#"mode = "closed", qd = 4, sizes = "16k", read_fraction = 0.5"#;
const GP2: &str = r#"preset = "gp2""#;

fn run_toml(toml: &str) -> SimReport {
    let s = Scenario::from_toml_str(toml).unwrap();
    run(
        &s,
        RunOptions {
            seed: 7,
            ..RunOptions::default()
        },
    )
    .unwrap()
}

fn details(r: &SimReport) -> &GroupDetails {
    &r.results[0].details.groups[0]
}

fn rebuild(r: &SimReport) -> &RebuildDetails {
    details(r).rebuild.as_ref().expect("rebuild details")
}

#[test]
fn the_copy_moves_exactly_the_volume_in_io_sized_chunks() {
    // 0.001 GiB = 1,073,741 bytes: four full 256 KiB chunks and a partial one.
    let r = run_toml(&scenario(
        0.001,
        GP2,
        BUSY,
        "rebuild = { io_kib = 256, qd = 2 }",
    ));
    let b = rebuild(&r);
    let size = (0.001 * GIB) as u64;
    assert_eq!(b.bytes_copied, size);
    assert_eq!((b.copy_reads, b.copy_writes), (5, 5));
    assert_eq!((b.started, b.copied, b.skipped), (1, 1, 0));

    // 1 GiB in 256 KiB chunks: 4,096 reads from the old volume, 4,096 writes to the new.
    let r = run_toml(&scenario(
        1.0,
        GP2,
        BUSY,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    let b = rebuild(&r);
    assert_eq!(b.bytes_copied, 1 << 30);
    assert_eq!((b.copy_reads, b.copy_writes), (4_096, 4_096));
    assert_eq!(details(&r).volumes_created, 2);
    // The copy is not the tenant's I/O: its 2 GiB moved are not in the group's bytes.
    let g = &r.results[0].groups[0];
    assert!(
        g.bytes_per_s * 10.0 < 1.0 * GIB,
        "tenant bytes/s {}",
        g.bytes_per_s
    );
}

#[test]
fn the_copy_is_paced_by_the_volumes_iops_and_throughput_limits() {
    // 64 MiB at 256 KiB = 256 reads and 256 writes on volumes capped at 50 IOPS: reads and
    // writes run in parallel on the two volumes, so at least 256 / 50 = 5.12 s.
    let capped = "baseline_iops = 50.0, ceiling_iops = 50.0";
    let r = run_toml(&scenario(
        0.0625,
        capped,
        IDLE,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    let b = rebuild(&r);
    assert_eq!((b.copy_reads, b.copy_writes), (256, 256));
    assert!(
        (5.12 * 0.99..5.12 * 1.1).contains(&b.copy_s_mean),
        "copy took {} s",
        b.copy_s_mean
    );
    // Without a cap the same copy is over in a blink.
    let r = run_toml(&scenario(
        0.0625,
        "baseline_iops = 1e9",
        IDLE,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    assert!(
        rebuild(&r).copy_s_mean < 0.1,
        "uncapped copy took {} s",
        rebuild(&r).copy_s_mean
    );
    // gp2 at 1 GiB: 128 MiB/s per volume, so 1 GiB takes 8 s (less the one 2 ms chunk the
    // byte bucket lets through at once); its 8,192 I/O units in 8 s are far from the 3,000
    // IOPS cap, so throughput is what paces it.
    let r = run_toml(&scenario(
        1.0,
        GP2,
        IDLE,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    let took = rebuild(&r).copy_s_mean;
    assert!((7.99..8.4).contains(&took), "gp2 copy took {took} s");
}

#[test]
fn the_tenant_loses_iops_while_its_volume_is_rebuilt() {
    let plain = run_toml(&scenario(1.0, GP2, BUSY, ""));
    assert!(details(&plain).rebuild.is_none());
    let plain_iops = plain.results[0].groups[0].iops;
    assert!(plain_iops > 2_950.0, "without rebuild {plain_iops}");
    for mode in ["raid1", "new_volume"] {
        let r = run_toml(&scenario(
            1.0,
            GP2,
            BUSY,
            &format!("rebuild = {{ io_kib = 256, qd = 4, tenant_io = \"{mode}\" }}"),
        ));
        let b = rebuild(&r);
        let iops = r.results[0].groups[0].iops;
        // The window is 10 s and the copy takes ~8 s of it: the tenant must lose a lot.
        assert!(
            iops < 0.8 * plain_iops,
            "{mode}: {iops} IOPS with rebuild vs {plain_iops} without"
        );
        if mode == "raid1" {
            assert!(b.tenant_reads_from_old > 0 && b.tenant_writes_mirrored > 0);
            // Reads go to the old volume only for data not yet copied: on average half.
            let reads = iops * 10.0 * 0.5;
            assert!(
                (b.tenant_reads_from_old as f64) < 0.8 * reads,
                "{} of ~{reads} reads from the old volume",
                b.tenant_reads_from_old
            );
        } else {
            assert_eq!((b.tenant_reads_from_old, b.tenant_writes_mirrored), (0, 0));
        }
    }
}

#[test]
fn the_old_volume_is_billed_until_the_copy_is_done_or_overlap_s_has_passed() {
    let hours = |r: &SimReport| details(r).provisioned_gib_hours;
    // Released when the copy is done: 30 s of one volume plus the copy time.
    let r = run_toml(&scenario(
        1.0,
        GP2,
        IDLE,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    let b = rebuild(&r);
    assert!(b.copy_s_mean > 7.99);
    assert!((b.overlap_s_mean - b.copy_s_mean).abs() < 1e-6);
    let want = (30.0 + b.copy_s_mean) / 3600.0;
    assert!((hours(&r) - want).abs() < 1e-9, "{} vs {want}", hours(&r));
    // overlap_s longer than the copy: billed overlap_s.
    let r = run_toml(&scenario(
        1.0,
        GP2,
        IDLE,
        "overlap_s = 15.0\nrebuild = { io_kib = 256, qd = 4 }",
    ));
    assert!((rebuild(&r).overlap_s_mean - 15.0).abs() < 1e-6);
    assert!((hours(&r) - 45.0 / 3600.0).abs() < 1e-9);
    // A copy still running at the end is billed to the end: 10 GiB cannot be copied in the
    // 20 s left at 128 MiB/s.
    let r = run_toml(&scenario(
        10.0,
        GP2,
        IDLE,
        "rebuild = { io_kib = 256, qd = 4 }",
    ));
    let b = rebuild(&r);
    assert_eq!((b.started, b.copied), (1, 0));
    assert!(b.bytes_copied < 10 << 30);
    assert!((hours(&r) - 10.0 * 50.0 / 3600.0).abs() < 1e-9);
}

#[test]
fn a_replacement_while_the_previous_copy_runs_is_skipped() {
    // Every 3 s, but a 1 GiB copy takes ~8 s: of the replacements at 10, 13, ..., 28 s only
    // those after a release start a rebuild.
    let r = run_toml(&scenario(
        1.0,
        GP2,
        IDLE,
        "every_s = 3.0\nrebuild = { io_kib = 256, qd = 4 }",
    ));
    let b = rebuild(&r);
    assert_eq!(b.started + b.skipped, 7, "{b:?}");
    assert!(b.skipped >= 4, "{b:?}");
    assert_eq!(details(&r).volumes_created, 1 + b.started);
}

#[test]
fn rebuild_runs_are_deterministic() {
    let toml = scenario(0.25, GP2, BUSY, "rebuild = { io_kib = 64, qd = 8 }");
    let a = serde_json::to_string(&run_toml(&toml)).unwrap();
    let b = serde_json::to_string(&run_toml(&toml)).unwrap();
    assert_eq!(a, b);
    assert!(a.contains("\"bytes_copied\":268435456"), "{a}");
}
