//! The CLI contract: `headroom volume ...` against a running server, and `headroom qos preview`
//! reproducing the published burst timelines.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::Command;

use common::{BIN, Server, text};
use serde_json::Value;

#[test]
fn volume_commands_follow_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "8GiB");

    let out = server.cli(&["volume", "create", "v1", "--size", "1GiB"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = server.cli(&["volume", "create", "v2", "--size", "512MiB"]);
    assert!(out.status.success(), "{}", text(&out));

    let out = server.cli(&["volume", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut pairs: Vec<(String, u64)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_string(),
                v["size_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    pairs.sort();
    assert_eq!(
        pairs,
        vec![("v1".into(), 1 << 30), ("v2".into(), 512 << 20)]
    );

    let out = server.cli(&["volume", "list"]);
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        listing.contains("v2")
            && listing.lines().next().is_some_and(|header| {
                header.split_whitespace().eq([
                    "NAME",
                    "TENANT",
                    "ACCESS",
                    "SIZE",
                    "ALLOCATED",
                    "CREDITS",
                    "QOS",
                ])
            }),
        "{}",
        text(&out)
    );

    let out = server.cli(&["volume", "resize", "v1", "--size", "2GiB"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = server.cli(&["volume", "show", "v1", "--json"]);
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["size_bytes"].as_u64(), Some(2 << 30));

    // Errors are clear and non-zero.
    let out = server.cli(&["volume", "create", "v1", "--size", "1GiB"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("v1"),
        "{}",
        text(&out)
    );
    let out = server.cli(&["volume", "show", "nope"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("404"),
        "{}",
        text(&out)
    );
    let out = server.cli(&["volume", "create", "bad/name", "--size", "1GiB"]);
    assert!(!out.status.success(), "{}", text(&out));
    let out = server.cli(&["volume", "create", "v3", "--size", "lots"]);
    assert!(!out.status.success(), "{}", text(&out));

    let out = server.cli(&["volume", "delete", "v2"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = server.cli(&["volume", "show", "v2"]);
    assert!(!out.status.success());

    // Raw API: the documented POST body works too.
    let out = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import json,urllib.request as u;r=u.urlopen(u.Request('{}/v1/volumes',data=json.dumps({{'name':'raw','size_bytes':1073741824}}).encode(),headers={{'Content-Type':'application/json','Authorization':'Bearer {}'}},method='POST'));print(r.status, r.read().decode())",
            server.api,
            common::TEST_TOKEN
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("201"),
        "{}",
        text(&out)
    );
    server.stop();
}

#[test]
fn cli_reports_an_unreachable_api() {
    let out = Command::new(BIN)
        .args(["volume", "list", "--api", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach"),
        "{}",
        text(&out)
    );
}

fn preview(args: &[&str]) -> Vec<Value> {
    let out = Command::new(BIN)
        .args(["qos", "preview", "--json"])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    json["rows"].as_array().unwrap().clone()
}

#[test]
fn qos_preview_gp2_bursts_2000_seconds_then_holds_baseline() {
    let rows = preview(&[
        "--preset",
        "gp2",
        "--size",
        "100GiB",
        "--demand-iops",
        "3000",
        "--seconds",
        "2100",
    ]);
    assert_eq!(rows.len(), 2100);
    let iops = |t: usize| rows[t]["iops"].as_f64().unwrap();
    for t in 0..2000 {
        assert_eq!(iops(t), 3000.0, "second {t}");
    }
    for t in 2000..2100 {
        assert_eq!(iops(t), 300.0, "second {t}");
    }
    assert_eq!(rows[2099]["credit_balance"].as_f64(), Some(0.0));
}

#[test]
fn qos_preview_qemu_bursts_12_5_seconds_then_holds_1000() {
    let rows = preview(&[
        "--preset",
        "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10",
        "--demand-iops",
        "5000",
        "--io-size",
        "4KiB",
        "--seconds",
        "30",
    ]);
    let iops: Vec<f64> = rows.iter().map(|r| r["iops"].as_f64().unwrap()).collect();
    // 12 full seconds at the burst rate, half a second of burst in second 13, then the baseline.
    for (t, value) in iops.iter().enumerate().take(12) {
        assert!(*value >= 5000.0, "second {t}: {value}");
    }
    let burst_total: f64 = iops.iter().take(13).sum();
    let expected = 12.5 * 5000.0 + 0.5 * 1000.0;
    assert!(
        (burst_total - expected).abs() <= 600.0,
        "first 13 s: {burst_total} vs {expected}"
    );
    for (t, value) in iops.iter().enumerate().skip(13) {
        assert_eq!(*value, 1000.0, "second {t}");
    }
}

#[test]
fn demo_serves_a_sample_volume_and_stops_on_sigint() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["demo", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .args(["--device-size", "2GiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut banner = String::new();
    let ready = loop {
        let line = lines.next().expect("demo printed its address").unwrap();
        if line.starts_with("nbd://") {
            break line;
        }
        banner.push_str(&line);
        banner.push('\n');
    };
    assert!(
        banner.contains("serving volume \"demo\" (1GiB, no QoS limit)"),
        "{banner}"
    );
    assert!(
        banner.contains("\"demo-qos\" (1GiB, QoS class qemu:"),
        "{banner}"
    );
    assert!(banner.contains("qemu-img") && banner.contains("fio") && banner.contains("nbdinfo"));
    let nbd = ready.split_whitespace().next().unwrap().to_string();
    assert!(banner.contains(&format!("{nbd}/demo")), "{banner}");

    let client =
        common::raw::Client::open(nbd.trim_start_matches("nbd://").parse().unwrap(), "demo");
    assert_eq!(client.size_bytes, 1 << 30);
    client.disconnect();
    // The second sample volume carries its class, as the API shows it.
    let api = ready.split_whitespace().nth(2).unwrap();
    // Started without HEADROOM_TOKEN: the token is the one `demo` wrote in its data directory.
    let token = std::fs::read_to_string(dir.path().join("data/api-token")).unwrap();
    let view: serde_json::Value = ureq::get(format!("{api}/v1/volumes/demo-qos"))
        .header("authorization", format!("Bearer {}", token.trim()))
        .call()
        .unwrap()
        .body_mut()
        .read_json()
        .unwrap();
    assert_eq!(view["policy"], "burst", "{view}");
    assert_eq!(view["qos_class"]["baseline"]["iops"], 1000, "{view}");
    assert_eq!(view["qos_class"]["ceiling"]["iops"], 5000, "{view}");
    assert_eq!(view["credits"]["iops"], 50_000, "{view}");

    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "demo exited with {exit} after SIGINT");
}
