//! The CLI contract: `headroom volume ...` and `headroom pool` against a running server (a
//! table for people, `--json` for scripts, the exit codes of docs/operations.md), `headroom
//! qos preview` reproducing the published burst timelines, and a closed stdout pipe ending
//! every command quietly.
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
                    "REPLICAS",
                    "HEALTH",
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
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
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
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let api = format!("http://127.0.0.1:{port}");
    for args in [
        &["volume", "list"][..],
        &["volume", "show", "v1"],
        &["volume", "create", "v1", "--size", "1GiB"],
        &["pool"],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .args(["--api", &api])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(4), "{args:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        // What went wrong, and what to try.
        assert!(
            stderr.contains("cannot reach")
                && stderr.contains(&api)
                && stderr.contains("headroom serve")
                && stderr.contains("HEADROOM_API"),
            "{args:?}: {}",
            text(&out)
        );
        assert!(out.stdout.is_empty(), "{}", text(&out));
    }
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

    // Every command the banner suggests works as printed, from another directory (another
    // terminal), fio's only with a 1 s run instead of 10 and 20.
    let commands = suggested_commands(&banner);
    assert!(commands.len() >= 7, "{commands:#?}\n{banner}");
    assert!(
        commands.iter().any(|c| c.contains(" volume show demo-qos")),
        "{commands:#?}"
    );
    let tools = ["nbdinfo", "qemu-img", "fio"];
    if tools.iter().all(|t| common::have_tool(t)) {
        let elsewhere = tempfile::tempdir().unwrap();
        for command in &commands {
            let run = command
                .replace("--runtime=10 ", "--runtime=1 ")
                .replace("--runtime=20 ", "--runtime=1 ");
            let out = Command::new("sh")
                .args(["-c", &run])
                .current_dir(elsewhere.path())
                .env_remove("HEADROOM_TOKEN")
                .env_remove("HEADROOM_API")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "the demo suggests `{command}`, which fails: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if command.contains(" volume show ") {
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(text.contains("demo-qos"), "{text}");
            }
        }
        println!("ran the demo's {} suggested commands", commands.len());
    }

    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "demo exited with {exit} after SIGINT");
}

/// The command lines of the demo's banner: its indented lines after "Try", without their
/// trailing comments.
fn suggested_commands(banner: &str) -> Vec<String> {
    banner
        .lines()
        .skip_while(|line| !line.starts_with("Try"))
        .filter_map(|line| line.strip_prefix("  "))
        .map(|line| line.split("  #").next().unwrap_or(line).trim().to_string())
        .filter(|line| !line.is_empty())
        .collect()
}

/// The cell of a right-aligned column: the last word of `row` ending where `header` ends in
/// the header line.
fn right_cell<'a>(header_line: &str, header: &str, row: &'a str) -> &'a str {
    let end = header_line.find(header).expect("header present") + header.len();
    assert!(
        row.len() >= end && row[end..].chars().next().is_none_or(|c| c == ' '),
        "{header} not aligned in {row:?}"
    );
    row[..end].split_whitespace().last().unwrap_or_default()
}

fn json_out(out: &std::process::Output) -> Value {
    assert!(out.status.success(), "{}", text(out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|err| panic!("{err}: {}", text(out)))
}

#[test]
fn every_command_prints_a_table_or_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "8GiB");

    // create: a sentence, or the VolumeView.
    let view = json_out(&server.cli(&[
        "volume", "create", "big", "--size", "100GiB", "--qos", "gp2", "--json",
    ]));
    assert_eq!(view["name"], "big");
    assert_eq!(view["size_bytes"].as_u64(), Some(100 << 30));
    assert_eq!(view["qos_class"]["spec"]["preset"], "gp2");
    let out = server.cli(&["volume", "create", "small", "--size", "512MiB"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "created small (512MiB), qos unlimited",
        "{}",
        text(&out)
    );

    // list: aligned columns (SIZE and CREDITS right-aligned under their header).
    let out = server.cli(&["volume", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !listing.contains('\x1b'),
        "no colour into a pipe: {listing:?}"
    );
    let mut lines = listing.lines();
    let header = lines.next().unwrap();
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 2, "{listing}");
    let row = |name: &str| *rows.iter().find(|r| r.starts_with(name)).unwrap();
    assert_eq!(
        right_cell(header, "SIZE", row("big")),
        "100GiB",
        "{listing}"
    );
    assert_eq!(
        right_cell(header, "SIZE", row("small")),
        "512MiB",
        "{listing}"
    );
    assert_eq!(
        right_cell(header, "CREDITS", row("small")),
        "-",
        "{listing}"
    );
    assert!(
        right_cell(header, "CREDITS", row("big"))
            .parse::<u64>()
            .unwrap()
            > 5_000_000,
        "{listing}"
    );

    // qos, resize: sentences or the VolumeView.
    let view = json_out(&server.cli(&["volume", "qos", "big", "--ceiling-iops", "800", "--json"]));
    assert_eq!(view["qos_class"]["ceiling"]["iops"], 800, "{view}");
    let view = json_out(&server.cli(&["volume", "qos", "small", "--json"]));
    assert!(view.get("qos_class").is_none_or(Value::is_null), "{view}");
    let view = json_out(&server.cli(&["volume", "resize", "small", "--size", "1GiB", "--json"]));
    assert_eq!(view["size_bytes"].as_u64(), Some(1 << 30));
    let out = server.cli(&["volume", "resize", "small", "--size", "2GiB"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "resized small to 2GiB"
    );

    // show: the phase table's columns line up.
    let out = server.cli(&["volume", "show", "big"]);
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    let phase_header = shown
        .lines()
        .find(|l| l.starts_with("PHASE"))
        .unwrap_or_else(|| panic!("{shown}"));
    let baseline = shown.lines().find(|l| l.starts_with("baseline ")).unwrap();
    assert_eq!(right_cell(phase_header, "I/OS", baseline), "0", "{shown}");
    assert_eq!(
        right_cell(phase_header, "TIME (S)", baseline),
        "0.000",
        "{shown}"
    );

    // pool: the summary and one row per device, or the API's JSON.
    let pool = json_out(&server.cli(&["pool", "--json"]));
    assert_eq!(pool["capacity_bytes"].as_u64(), Some(8 << 30), "{pool}");
    let devices = pool["devices"].as_array().unwrap();
    let out = server.cli(&["pool"]);
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let capacity_line = table.lines().find(|l| l.starts_with("capacity:")).unwrap();
    assert!(
        capacity_line.contains(&format!("8GiB on {} device(s)", devices.len())),
        "{table}"
    );
    let header = table.lines().find(|l| l.contains("DEVICE")).unwrap();
    let device_rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.contains("DEVICE"))
        .skip(1)
        .collect();
    assert_eq!(device_rows.len(), devices.len(), "{table}");
    for (row, device) in device_rows.iter().zip(devices) {
        assert_eq!(
            right_cell(header, "DEVICE", row),
            device["id"].to_string(),
            "{table}"
        );
        assert!(row.ends_with(device["path"].as_str().unwrap()), "{table}");
    }
    let allocated = pool["allocated_extents"].as_u64().unwrap();
    assert!(
        allocated > 0 || devices.is_empty() || table.contains("0B ("),
        "{table}"
    );

    // delete: a sentence, or {"deleted": NAME}.
    let gone = json_out(&server.cli(&["volume", "delete", "small", "--json"]));
    assert_eq!(gone, serde_json::json!({"deleted": "small"}));
    let out = server.cli(&["volume", "delete", "big"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "deleted big");
    let list = json_out(&server.cli(&["volume", "list", "--json"]));
    assert_eq!(list, serde_json::json!([]));
    server.stop();

    // qos preview: per second, in human units.
    let out = Command::new(BIN)
        .args(["qos", "preview", "--preset", "gp2", "--size", "100GiB"])
        .args(["--demand-iops", "3000", "--seconds", "3"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(
        lines[0]
            .split_whitespace()
            .eq(["T_S", "IOPS", "THROUGHPUT", "CREDITS"]),
        "{table}"
    );
    assert_eq!(right_cell(lines[0], "IOPS", lines[1]), "3,000", "{table}");
    assert_eq!(right_cell(lines[0], "T_S", lines[3]), "2", "{table}");
}

#[test]
fn exit_codes_follow_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "4GiB");
    server.create_volume("v1", "1GiB");
    let code = |args: &[&str]| {
        let out = server.cli(args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };

    // 3: not found, with a hint.
    for args in [
        &["volume", "show", "nope"][..],
        &["volume", "delete", "nope"],
        &["volume", "resize", "nope", "--size", "2GiB"],
        &["volume", "qos", "nope", "--ceiling-iops", "100"],
    ] {
        let (status, stderr) = code(args);
        assert_eq!(status, Some(3), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains("nope"),
            "{stderr}"
        );
        assert!(stderr.contains("headroom volume list"), "{stderr}");
    }
    // 6: conflict (the name is taken).
    let (status, stderr) = code(&["volume", "create", "v1", "--size", "1GiB"]);
    assert_eq!(status, Some(6), "{stderr}");
    assert!(stderr.contains("v1"), "{stderr}");
    // 1: other failures (an invalid class, a bad name).
    let (status, stderr) = code(&[
        "volume",
        "create",
        "v2",
        "--size",
        "1GiB",
        "--baseline-iops",
        "500",
        "--ceiling-iops",
        "100",
    ]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("invalid QoS"), "{stderr}");
    let (status, stderr) = code(&["volume", "create", "bad/name", "--size", "1GiB"]);
    assert_eq!(status, Some(1), "{stderr}");
    // 2: usage errors, with clap's message.
    for args in [
        &["volume", "create", "v3", "--size", "lots"][..],
        &[
            "volume",
            "create",
            "v3",
            "--size",
            "1GiB",
            "--burst",
            "sometimes",
        ],
        &["volume", "list", "--bogus"],
        &["pool", "extra"],
        &["nonsense"],
    ] {
        let (status, stderr) = code(args);
        assert_eq!(status, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("--help"), "{stderr}");
    }
    server.stop();

    // 5: the API refused the token (a one-shot HTTP server answering 401).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let api = format!("http://{}", listener.local_addr().unwrap());
    let responder = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).unwrap();
            assert!(n > 0, "client closed early");
            request.extend_from_slice(&buf[..n]);
        }
        let body = r#"{"error":"missing or wrong bearer token","kind":"unauthorized"}"#;
        write!(
            stream,
            "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let out = Command::new(BIN)
        .args(["volume", "list", "--api", &api])
        .output()
        .unwrap();
    responder.join().unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("HEADROOM_TOKEN"),
        "{}",
        text(&out)
    );

    // The codes are in --help.
    for args in [&["--help"][..], &["volume", "--help"], &["pool", "--help"]] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("Exit codes:") && help.contains("4  server unreachable"),
            "{args:?}: {help}"
        );
    }
}

/// No panic message, status 0, nothing on stderr.
fn assert_quiet(what: &str, status: std::process::ExitStatus, stderr: &[u8]) {
    let stderr = String::from_utf8_lossy(stderr);
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert!(stderr.trim().is_empty(), "{what}: {stderr}");
    assert_eq!(status.code(), Some(0), "{what}: {status}, {stderr}");
}

#[test]
fn a_closed_pipe_ends_every_command_quietly() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::Stdio;

    // `qos preview ... | head -1`: a table far larger than the pipe buffer; the reader takes
    // one line and goes away while the writer is blocked on the full pipe.
    let mut child = Command::new(BIN)
        .args(["qos", "preview", "--preset", "gp2", "--size", "100GiB"])
        .args(["--demand-iops", "3000", "--seconds", "30000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(first.contains("T_S"), "{first}");
    drop(reader);
    let mut stderr = Vec::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_end(&mut stderr)
        .unwrap();
    assert_quiet("qos preview | head -1", child.wait().unwrap(), &stderr);

    // Commands with short output: the reader is gone before they write (a pipe whose read
    // end is closed), which is `| head -0` or a reader that exited early.
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "2GiB");
    server.create_volume("v1", "1GiB");
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scenarios/libra-vop.toml"
    );
    for args in [
        &["volume", "list"][..],
        &["volume", "list", "--json"],
        &["volume", "show", "v1"],
        &["pool"],
        &["sim", "run", scenario],
        &["sim", "run", scenario, "--json"],
        &[
            "qos",
            "preview",
            "--preset",
            "gp2",
            "--json",
            "--seconds",
            "10",
        ],
    ] {
        let (read_end, write_end) = std::io::pipe().unwrap();
        drop(read_end);
        let out = Command::new(BIN)
            .args(args)
            .env("HEADROOM_API", &server.api)
            .env("HEADROOM_TOKEN", common::TEST_TOKEN)
            .stdout(Stdio::from(write_end))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_quiet(&format!("{args:?}"), out.status, &out.stderr);
    }
    server.stop();
}

#[test]
fn sim_and_calibrate_print_a_table_or_json() {
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scenarios/libra-vop.toml"
    );
    let report = json_out(
        &Command::new(BIN)
            .args(["sim", "run", scenario, "--json"])
            .output()
            .unwrap(),
    );
    let results = report["results"].as_array().unwrap();
    let groups: usize = results
        .iter()
        .map(|r| r["groups"].as_array().unwrap().len())
        .sum();
    assert!(groups > 0, "{report}");
    let out = Command::new(BIN)
        .args(["sim", "run", scenario])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // No progress bar when stderr is not a terminal.
    assert!(out.stderr.is_empty(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0],
        format!("scenario {} (seed 1)", report["scenario"].as_str().unwrap())
    );
    assert!(
        lines[1]
            .split_whitespace()
            .take(3)
            .eq(["POLICY", "GROUP", "IOPS"]),
        "{table}"
    );
    assert_eq!(
        lines.len(),
        2 + groups,
        "one row per policy and group: {table}"
    );
    let first = &results[0]["groups"][0];
    assert_eq!(
        right_cell(lines[1], "IOPS", lines[2]),
        format!("{:.0}", first["iops"].as_f64().unwrap()),
        "{table}"
    );

    if !common::have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("calibration.toml");
    let report = json_out(
        &Command::new(BIN)
            .args([
                "calibrate",
                "--memory",
                "256MiB",
                "--seconds-per-point",
                "1",
            ])
            .args(["--sizes", "4k", "--json", "--out"])
            .arg(&file)
            .output()
            .unwrap(),
    );
    assert_eq!(report["file"].as_str(), file.to_str());
    assert!(file.exists());
    let points = report["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "a read and a write point: {report}");
    for point in points {
        assert_eq!(point["size_bytes"], 4096, "{report}");
        assert!(point["iops"].as_u64().unwrap() > 0, "{report}");
        assert!(point["cpu_ns"].as_u64().unwrap() > 0, "{report}");
    }
    assert!(report["cpu"]["read"]["base_ns"].is_u64(), "{report}");
    let sync = &report["sync_measurement"];
    assert!(sync["flushed_writes"].as_u64().unwrap() > 0, "{report}");
    assert!(
        sync["flushed_write_cpu_ns"].as_u64().unwrap() > 0
            && sync["plain_write_cpu_ns"].as_u64().unwrap() > 0,
        "{report}"
    );
    assert!(
        report["cpu"]["sync"]["base_ns"].as_u64().unwrap() >= 1,
        "{report}"
    );
    assert_eq!(
        report["capacity"]["device_units_per_s"].as_u64(),
        report["vop"]["max_iops"].as_u64().map(|n| n * 1000),
        "{report}"
    );
}
