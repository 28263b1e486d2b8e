//! Per-volume QoS through the CLI and the API: `volume create` with QoS flags, `volume qos`
//! changing a class live, `volume show`/`list` reporting it, and invalid QoS refused with its
//! reason and no change. Real server processes, real CLI processes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::time::Instant;

use common::{Server, text};
use serde_json::{Value, json};

/// Runs the CLI, asserts success, returns stdout.
fn ok(server: &Server, args: &[&str]) -> String {
    let out = server.cli(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// Runs the CLI, asserts failure with exit status 1, returns stderr.
fn fails(server: &Server, args: &[&str]) -> String {
    let out = server.cli(args);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
    String::from_utf8(out.stderr).unwrap()
}

fn show(server: &Server, name: &str) -> Value {
    serde_json::from_str(&ok(server, &["volume", "show", name, "--json"])).unwrap()
}

fn start() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "8GiB");
    (dir, server)
}

/// `n` serial 4 KiB writes on an open connection.
fn write_4k(client: &mut common::raw::Client, n: u64) {
    let block = [0x5au8; 4096];
    for i in 0..n {
        assert_eq!(client.write(i, (i % 256) * 4096, &block, 0), 0, "write {i}");
    }
}

fn total_ios(view: &Value) -> u64 {
    ["baseline", "burst_credit", "burst_spare"]
        .iter()
        .map(|phase| view["phases"][phase]["ios"].as_u64().unwrap())
        .sum()
}

#[test]
fn a_gp2_volume_shows_its_class_and_a_full_bucket() {
    let (_dir, server) = start();
    let out = ok(
        &server,
        &["volume", "create", "g", "--size", "100GiB", "--qos", "gp2"],
    );
    assert!(
        out.starts_with("created g (100GiB), qos gp2: baseline 300 IOPS"),
        "{out}"
    );
    assert!(out.contains("ceiling 3000 IOPS"), "{out}");
    assert!(out.contains("credits 5"), "{out}");

    let view = show(&server, "g");
    let qos = &view["qos_class"];
    assert_eq!(qos["spec"], json!({"preset": "gp2"}));
    assert_eq!(qos["baseline"]["iops"], 300);
    assert_eq!(qos["ceiling"]["iops"], 3000);
    assert_eq!(qos["burst"], "credits");
    assert_eq!(qos["iops_bucket"]["capacity"], 5_400_000);
    assert_eq!(qos["iops_bucket"]["refill_per_s"], 300);
    let credits = view["credits"]["iops"].as_u64().unwrap();
    assert!(
        (5_390_000..=5_400_000).contains(&credits),
        "credits {credits}"
    );
    assert_eq!(view["queued_requests"], 0);
    assert!(view["policy"].as_str().is_some_and(|p| !p.is_empty()));

    // For people: the class, the bucket, the credits and the phase table.
    let human = ok(&server, &["volume", "show", "g"]);
    for expected in [
        "size:        100GiB (107374182400 bytes)",
        "qos:         gp2",
        "baseline:  300 IOPS",
        "ceiling:   3000 IOPS",
        "burst:     credits",
        "iops bucket:  5400000 credits, refill 300/s",
        "I/O credits",
        "burst on credits",
        "burst on spare capacity",
        "throttled",
    ] {
        assert!(human.contains(expected), "{expected:?} missing:\n{human}");
    }

    // A resize re-derives the size-dependent class: 3 IOPS per GiB.
    ok(&server, &["volume", "resize", "g", "--size", "200GiB"]);
    let view = show(&server, "g");
    assert_eq!(view["qos_class"]["baseline"]["iops"], 600);
    assert_eq!(view["qos_class"]["spec"], json!({"preset": "gp2"}));
    server.stop();
}

#[test]
fn burst_none_fixes_the_ceiling_at_the_baseline_and_no_qos_is_unlimited() {
    let (_dir, server) = start();
    let out = ok(
        &server,
        &[
            "volume",
            "create",
            "fixed",
            "--size",
            "1GiB",
            "--baseline-iops",
            "500",
            "--burst",
            "none",
        ],
    );
    assert!(
        out.contains(
            "qos custom (baseline-iops=500, burst=none): baseline 500 IOPS, ceiling 500 IOPS, no burst"
        ),
        "{out}"
    );
    let view = show(&server, "fixed");
    let qos = &view["qos_class"];
    assert_eq!(qos["spec"], json!({"baseline_iops": 500, "burst": "none"}));
    assert_eq!(qos["baseline"]["iops"], 500);
    assert_eq!(qos["ceiling"]["iops"], 500);
    assert_eq!(qos["burst"], "none");
    assert!(qos.get("iops_bucket").is_none_or(Value::is_null), "{qos}");
    assert_eq!(view["credits"]["iops"], Value::Null);

    let out = ok(&server, &["volume", "create", "free", "--size", "1GiB"]);
    assert_eq!(out.trim(), "created free (1GiB), qos unlimited");
    let view = show(&server, "free");
    assert!(view.get("qos_class").is_none_or(Value::is_null), "{view}");
    assert_eq!(view["credits"], json!({"iops": null, "bytes": null}));
    let human = ok(&server, &["volume", "show", "free"]);
    assert!(human.contains("qos:         unlimited"), "{human}");
    let out = ok(&server, &["volume", "qos", "free"]);
    assert_eq!(out.trim(), "free: qos unlimited");

    ok(
        &server,
        &["volume", "create", "g", "--size", "100GiB", "--qos", "gp2"],
    );
    // The list: machine and human.
    let list: Value = serde_json::from_str(&ok(&server, &["volume", "list", "--json"])).unwrap();
    let mut names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["fixed", "free", "g"]);
    let gp2 = list
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "g")
        .unwrap();
    assert_eq!(gp2["qos_class"]["iops_bucket"]["capacity"], 5_400_000);

    let human = ok(&server, &["volume", "list"]);
    let row = |name: &str| -> Vec<String> {
        human
            .lines()
            .find(|line| line.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{human}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        row("NAME"),
        [
            "NAME",
            "TENANT",
            "ACCESS",
            "REPLICAS",
            "HEALTH",
            "SIZE",
            "ALLOCATED",
            "CREDITS",
            "QOS"
        ],
        "{human}"
    );
    assert_eq!(row("free")[7..], ["-", "-"], "{human}");
    assert_eq!(row("fixed")[7..], ["-", "custom"], "{human}");
    assert_eq!(row("g")[8], "gp2", "{human}");
    assert!(row("g")[7].starts_with("5"), "{human}");
    server.stop();
}

#[test]
fn a_live_qos_change_applies_at_once_and_never_adds_credits() {
    let (_dir, server) = start();
    ok(
        &server,
        &["volume", "create", "g", "--size", "100GiB", "--qos", "gp2"],
    );
    let before = show(&server, "g")["credits"]["iops"].as_u64().unwrap();
    let out = ok(&server, &["volume", "qos", "g", "--ceiling-iops", "800"]);
    assert!(
        out.starts_with("g: qos gp2 (ceiling-iops=800): baseline 300 IOPS"),
        "{out}"
    );
    assert!(out.contains("ceiling 800 IOPS"), "{out}");
    let view = show(&server, "g");
    let qos = &view["qos_class"];
    assert_eq!(qos["spec"], json!({"preset": "gp2", "ceiling_iops": 800}));
    assert_eq!(qos["ceiling"]["iops"], 800);
    assert_eq!(qos["baseline"]["iops"], 300);
    assert_eq!(qos["iops_bucket"]["capacity"], 5_400_000);
    let after = view["credits"]["iops"].as_u64().unwrap();
    assert!(after <= before, "credits grew from {before} to {after}");
    // Without flags: the current class, unchanged.
    let out = ok(&server, &["volume", "qos", "g"]);
    assert!(out.contains("ceiling 800 IOPS"), "{out}");

    // A credit class with a 1 IOPS refill: serial writes spend its credits, and a change that
    // grows the bucket must not refill it.
    ok(
        &server,
        &[
            "volume",
            "create",
            "c",
            "--size",
            "1GiB",
            "--baseline-iops",
            "1",
            "--ceiling-iops",
            "100000",
            "--burst",
            "credits",
        ],
    );
    let capacity = 99_999 * 1_800;
    let view = show(&server, "c");
    assert_eq!(view["qos_class"]["iops_bucket"]["capacity"], capacity);
    assert_eq!(view["qos_class"]["iops_bucket"]["refill_per_s"], 1);
    let mut client = common::raw::Client::open(server.nbd, "c");
    write_4k(&mut client, 300);
    let view = show(&server, "c");
    let spent = view["credits"]["iops"].as_u64().unwrap();
    assert!(spent <= capacity - 200, "credits {spent} of {capacity}");
    assert_eq!(total_ios(&view), 300, "{view}");

    let t0 = Instant::now();
    let out = ok(&server, &["volume", "qos", "c", "--ceiling-iops", "200000"]);
    let view = show(&server, "c");
    let elapsed_s = t0.elapsed().as_secs() + 1;
    assert!(out.contains("ceiling 200000 IOPS"), "{out}");
    assert_eq!(
        view["qos_class"]["iops_bucket"]["capacity"],
        199_999 * 1_800
    );
    let now = view["credits"]["iops"].as_u64().unwrap();
    // At most the refill (1 credit/s) of the time the change took.
    assert!(
        now <= spent + elapsed_s,
        "credits went from {spent} to {now} in {elapsed_s} s"
    );
    // The open connection goes on under the new class, without reconnecting.
    write_4k(&mut client, 10);
    assert_eq!(total_ios(&show(&server, "c")), 310);
    client.disconnect();
    server.stop();
}

#[test]
fn a_live_change_throttles_an_open_connection() {
    let (_dir, server) = start();
    ok(&server, &["volume", "create", "v", "--size", "1GiB"]);
    let mut client = common::raw::Client::open(server.nbd, "v");
    write_4k(&mut client, 20);
    assert_eq!(show(&server, "v")["phases"]["throttled"]["ios"], 0);

    ok(
        &server,
        &[
            "volume",
            "qos",
            "v",
            "--baseline-iops",
            "100",
            "--burst",
            "none",
        ],
    );
    // 100 IOPS: 100 more writes take about a second.
    let t0 = Instant::now();
    write_4k(&mut client, 100);
    let elapsed = t0.elapsed();
    let view = show(&server, "v");
    assert!(
        elapsed.as_secs_f64() >= 0.5,
        "100 writes at 100 IOPS took {elapsed:?}"
    );
    assert!(
        view["phases"]["throttled"]["ios"].as_u64().unwrap() > 0,
        "{view}"
    );
    assert_eq!(total_ios(&view), 120, "{view}");
    client.disconnect();
    server.stop();
}

#[test]
fn invalid_qos_is_refused_with_its_reason_and_changes_nothing() {
    let (_dir, server) = start();
    let bad = [
        (
            &["--baseline-iops", "500", "--ceiling-iops", "100"][..],
            "ceiling_iops 100 is below baseline_iops 500",
        ),
        (&["--qos", "nosuch"][..], "unknown preset \"nosuch\""),
        (
            &["--ceiling-iops", "0"][..],
            "ceiling_iops must be > 0 (omit it for no ceiling)",
        ),
        (&["--weight", "0"][..], "weight 0"),
    ];
    for (flags, reason) in bad {
        let mut args = vec!["volume", "create", "bad", "--size", "1GiB"];
        args.extend_from_slice(flags);
        let err = fails(&server, &args);
        assert!(err.starts_with("error: invalid QoS: "), "{err}");
        assert!(err.contains(reason), "{reason:?} missing: {err}");
        assert_eq!(err.matches("invalid QoS").count(), 1, "{err}");
    }
    // Not created: not found, exit code 3 (the CLI's contract).
    let out = server.cli(&["volume", "show", "bad"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("404"),
        "{}",
        text(&out)
    );

    // Changes: refused, and the volume keeps its class and credits.
    ok(
        &server,
        &["volume", "create", "g", "--size", "100GiB", "--qos", "gp2"],
    );
    let before = show(&server, "g");
    for (flags, reason) in bad {
        let mut args = vec!["volume", "qos", "g"];
        args.extend_from_slice(flags);
        let err = fails(&server, &args);
        assert!(err.starts_with("error: invalid QoS: "), "{err}");
        assert!(err.contains(reason), "{reason:?} missing: {err}");
        let after = show(&server, "g");
        assert_eq!(after["qos_class"], before["qos_class"], "{flags:?}");
        assert_eq!(after["size_bytes"], before["size_bytes"]);
        assert!(after["credits"]["iops"].as_u64() <= before["credits"]["iops"].as_u64());
    }
    // Invalid only once merged over the current spec.
    ok(
        &server,
        &[
            "volume",
            "create",
            "m",
            "--size",
            "1GiB",
            "--baseline-iops",
            "500",
        ],
    );
    let before = show(&server, "m");
    let err = fails(&server, &["volume", "qos", "m", "--ceiling-iops", "100"]);
    assert!(
        err.contains("ceiling_iops 100 is below baseline_iops 500"),
        "{err}"
    );
    assert_eq!(show(&server, "m")["qos_class"], before["qos_class"]);

    // clap refuses a bad --burst itself, naming the choices.
    let out = server.cli(&["volume", "qos", "g", "--burst", "sometimes"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("none, credits, on-demand"), "{err}");
    server.stop();
}

#[test]
fn the_api_takes_qos_objects_and_reports_invalid_qos_as_such() {
    let (_dir, server) = start();
    let agent = common::agent();
    let volumes = format!("{}/v1/volumes", server.api);
    let mut response = agent
        .post(&volumes)
        .header("authorization", common::bearer())
        .send_json(json!({"name": "a", "size_bytes": 1u64 << 30, "qos": {"preset": "gp2"}}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["qos_class"]["baseline"]["iops"], 100); // gp2's floor
    assert_eq!(body["qos_class"]["spec"], json!({"preset": "gp2"}));

    let mut response = agent
        .patch(format!("{volumes}/a"))
        .header("authorization", common::bearer())
        .send_json(json!({"qos": {"ceiling_iops": 0}}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "invalid_qos");
    assert!(
        body["error"].as_str().unwrap().contains("ceiling_iops"),
        "{body}"
    );

    let mut response = agent
        .patch(format!("{volumes}/a"))
        .header("authorization", common::bearer())
        .send_json(json!({"qos": {"weight": 7, "burst": "on-demand"}}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(
        body["qos_class"]["spec"],
        json!({"preset": "gp2", "weight": 7, "burst": "on-demand"})
    );
    assert_eq!(body["qos_class"]["burst"], "on-demand");
    assert_eq!(body["qos_class"]["weight"], 7);
    server.stop();
}
