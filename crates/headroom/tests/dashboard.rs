//! The live views, end to end: a real server under real fio load, `GET /v1/stats`, the
//! dashboard at `/` driven in headless Chromium through chromedriver (the W3C WebDriver
//! protocol: JSON over HTTP), and `headroom top --once`.
//!
//! The numbers the page shows are read from its DOM (`data-value` attributes) and checked
//! three ways: equal to the `/v1/stats` sample the page drew (same `unix_ms`), close to the
//! volume's own counters in `/v1/volumes` over the same seconds, and close to the load fio was
//! told to run (`--rate_iops`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, TEST_TOKEN, api_get, have_tool, text};
use serde_json::{Value, json};

/// fio's fixed rate on the unlimited volume.
const BUSY_IOPS: u64 = 2_000;
/// The credit volume's class: 400 IOPS baseline, bursts to 1,600 for about a minute.
const CREDIT_CLASS: &str = "qemu:iops-total=400,iops-total-max=1600,iops-total-max-length=60";
const CREDIT_CEILING_IOPS: f64 = 1_600.0;
/// The idle volume's baseline: all of it is lent.
const IDLE_BASELINE_IOPS: f64 = 1_000.0;

use common::agent;

/// `GET` with a bearer token; (status, body as JSON or Null).
fn get_with(url: &str, token: &str) -> (u16, Value) {
    let mut response = agent()
        .get(url)
        .header("Authorization", &format!("Bearer {token}"))
        .call()
        .unwrap_or_else(|err| panic!("GET {url}: {err}"));
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Completed I/Os of a volume since start, from its per-phase counters.
fn volume_ios(server: &Server, name: &str) -> u64 {
    let view = api_get(server, &format!("/v1/volumes/{name}"));
    ["baseline", "burst_credit", "burst_spare"]
        .iter()
        .map(|phase| view["phases"][phase]["ios"].as_u64().expect("phase ios"))
        .sum()
}

/// Background fio jobs, killed by PID when dropped (also when the test fails).
struct Load(Vec<Child>);

impl Load {
    fn start(jobs: &[(String, &[&str])], seconds: u32) -> Load {
        let children = jobs
            .iter()
            .map(|(uri, extra)| {
                Command::new("fio")
                    .args([
                        // One process (jobs as threads): the kill below ends all of it. A
                        // forked job process would outlive it, spinning on a dead server.
                        "--thread",
                        "--name=load",
                        "--ioengine=nbd",
                        &format!("--uri={uri}"),
                        "--bs=4k",
                        "--size=64M",
                        "--time_based",
                        &format!("--runtime={seconds}"),
                    ])
                    .args(*extra)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start fio")
            })
            .collect();
        Load(children)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `check` every 100 ms until it returns `Some` or `deadline` passes.
fn wait_for<T>(what: &str, deadline: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A server with four volumes, two of them under fio load.
fn loaded_server(dir: &Path) -> (Server, Load) {
    let server = Server::start_memory(&dir.join("mem"), "2GiB");
    server.create_volume("busy", "256MiB");
    server.create_volume_with("credit", "256MiB", &["--qos", CREDIT_CLASS]);
    server.create_volume_with("idle", "256MiB", &["--baseline-iops", "1000"]);
    server.create_tenant("acme");
    server.create_volume_with("acme-data", "256MiB", &["--tenant", "acme"]);
    let rate = format!("--rate_iops={BUSY_IOPS}");
    let load = Load::start(
        &[
            (
                server.uri("busy"),
                &["--rw=randwrite", "--iodepth=4", rate.as_str()][..],
            ),
            (server.uri("credit"), &["--rw=randread", "--iodepth=8"][..]),
        ],
        180,
    );
    (server, load)
}

// ------------------------------------------------------------------------------ WebDriver

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The full path of `tool` on PATH (checked by `have_tool` first).
fn on_path(tool: &str) -> String {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(tool))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{tool} not on PATH"))
        .display()
        .to_string()
}

/// Every process under `pid` (children first found, then theirs), from /proc.
fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // "pid (comm) state ppid ...": comm may hold spaces; ppid follows the last ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|s| s.parse().ok());
            if let Some(ppid) = ppid {
                parent_of.push((child, ppid));
            }
        }
    }
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parent_of
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// chromedriver and the Chromium it starts; everything is killed by PID on drop.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start() -> Browser {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile::tempdir().expect("profile dir");
        let base = format!("http://127.0.0.1:{port}");
        let mut browser = Browser {
            driver,
            base,
            session: String::new(),
            _profile: profile,
        };
        wait_for("chromedriver to listen", Duration::from_secs(30), || {
            let response = agent()
                .get(format!("{}/status", browser.base))
                .call()
                .ok()?;
            (response.status() == 200).then_some(())
        });
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1400,1380",
            &format!("--user-data-dir={}", browser._profile.path().display()),
        ];
        let created = browser.call(
            "POST",
            "/session",
            Some(json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": on_path("chromium"), "args": args},
            }}})),
        );
        browser.session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session in {created}"))
            .to_string();
        browser
    }

    /// One WebDriver command; returns its `value`, panics on a WebDriver error.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let agent = agent();
        let result = match (method, body) {
            ("GET", _) => agent.get(&url).call(),
            ("DELETE", _) => agent.delete(&url).call(),
            (_, body) => agent
                .post(&url)
                .send_json(body.unwrap_or_else(|| json!({}))),
        };
        let mut response = result.unwrap_or_else(|err| panic!("{method} {path}: {err}"));
        let status = response.status();
        let answer: Value = response.body_mut().read_json().expect("WebDriver JSON");
        assert!(status == 200, "{method} {path}: {status} {answer}");
        answer["value"].clone()
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    fn navigate(&self, url: &str) {
        self.call(
            "POST",
            &self.session_path("/url"),
            Some(json!({"url": url})),
        );
    }

    /// Runs `script` (a function body) in the page and returns what it returns.
    fn execute(&self, script: &str) -> Value {
        self.call(
            "POST",
            &self.session_path("/execute/sync"),
            Some(json!({"script": script, "args": []})),
        )
    }

    fn screenshot(&self, path: &Path) {
        let encoded = self.call("GET", &self.session_path("/screenshot"), None);
        let png = base64_decode(encoded.as_str().expect("base64 screenshot"));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Collected first: Chromium's processes are chromedriver's children.
        let mut pids = descendants(self.driver.id());
        if !self.session.is_empty() {
            let url = format!("{}/session/{}", self.base, self.session);
            let _ = agent().delete(&url).call();
        }
        pids.extend(descendants(self.driver.id()));
        for pid in pids {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for v in text.bytes().filter_map(value) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// What the page shows, read from its DOM.
const READ_DOM: &str = r##"
const num = (el) => (el && el.dataset.value !== undefined && el.dataset.value !== "")
  ? Number(el.dataset.value) : null;
const rows = {};
for (const tr of document.querySelectorAll("#volumes-body tr[data-volume]")) {
  const f = (name) => tr.querySelector(`td[data-field="${name}"]`);
  rows[tr.dataset.volume] = {
    iops: num(f("iops")), bytes_per_s: num(f("bytes_per_s")),
    latency_us_mean: num(f("latency_us_mean")), queue_depth: num(f("queue_depth")),
    latency_us_p99: num(f("latency_us_p99")),
    promise: f("promise_short_seconds").textContent,
    promise_short_seconds: num(f("promise_short_seconds")),
    credits: num(f("credits")), tenant: f("tenant").textContent,
    phase: f("phase").dataset.value, bursting: tr.dataset.bursting === "true",
  };
}
const chips = (id) => [...document.querySelectorAll(`#${id} li[data-volume]`)]
  .map((li) => ({ name: li.dataset.volume, text: li.textContent,
                  unused_iops: li.dataset.unusedIops ? Number(li.dataset.unusedIops) : null }));
const message = document.getElementById("message");
return JSON.stringify({
  status: document.getElementById("status").dataset.state,
  unix_ms: Number(document.getElementById("sample-time").dataset.unixMs || 0),
  cpu: num(document.getElementById("util-cpu_ns")),
  node_iops: num(document.getElementById("node-iops")),
  rows, bursting: chips("bursting-list"), lending: chips("lending-list"),
  message: message.hidden ? null : { kind: message.dataset.kind, text: message.textContent },
});
"##;

fn read_dom(browser: &Browser) -> Value {
    let text = browser.execute(READ_DOM);
    serde_json::from_str(text.as_str().expect("JSON string")).expect("DOM JSON")
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance
}

#[test]
fn the_dashboard_shows_live_numbers_that_match_the_api() {
    if !(have_tool("fio") && have_tool("chromium") && have_tool("chromedriver")) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (server, _load) = loaded_server(dir.path());

    // The page is public and holds no data.
    let mut page = ureq::get(&server.api).call().expect("GET /");
    assert!(
        page.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/html")),
        "GET / is not HTML"
    );
    let html = page.body_mut().read_to_string().unwrap();
    assert!(html.contains("/assets/app.js") && !html.contains("busy"));

    let browser = Browser::start();
    browser.navigate(&format!("{}/#token={TEST_TOKEN}", server.api));

    // Live: both loaded volumes show I/O, and two more samples arrive after that, so the
    // sample read is a full second of steady load.
    let first = wait_for(
        "live data for busy and credit",
        Duration::from_secs(60),
        || {
            let dom = read_dom(&browser);
            let busy = dom["rows"]["busy"]["iops"].as_f64().unwrap_or(0.0);
            let credit = dom["rows"]["credit"]["iops"].as_f64().unwrap_or(0.0);
            (dom["status"] == "live" && busy > 0.0 && credit > 0.0)
                .then(|| dom["unix_ms"].as_u64().unwrap())
        },
    );
    let ios_before = (Instant::now(), volume_ios(&server, "credit"));
    let mut seen = vec![first];
    let dom = wait_for("two more samples", Duration::from_secs(20), || {
        let dom = read_dom(&browser);
        let at = dom["unix_ms"].as_u64().unwrap();
        if !seen.contains(&at) {
            seen.push(at);
        }
        (seen.len() >= 3).then_some(dom)
    });
    let ios_after = (Instant::now(), volume_ios(&server, "credit"));
    let stats = api_get(&server, "/v1/stats?seconds=600&limit=100");

    // 1. Exactly the sample the page drew (same unix_ms): the page shows what the API says.
    let unix_ms = dom["unix_ms"].as_u64().unwrap();
    let sample = stats["samples"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["unix_ms"] == unix_ms)
        .unwrap_or_else(|| panic!("no sample {unix_ms} in /v1/stats"));
    let api_rows: HashMap<&str, &Value> = sample["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    for name in ["busy", "credit", "idle", "acme-data"] {
        let shown = &dom["rows"][name];
        let api = api_rows
            .get(name)
            .unwrap_or_else(|| panic!("{name} not in the sample"));
        for field in [
            "iops",
            "bytes_per_s",
            "latency_us_mean",
            "latency_us_p99",
            "queue_depth",
        ] {
            assert_eq!(
                shown[field].as_f64(),
                api[field].as_f64(),
                "{name}.{field}: page {shown} vs API {api}"
            );
        }
        assert_eq!(shown["credits"].as_f64(), api["credits"]["iops"].as_f64());
    }
    assert_eq!(
        dom["cpu"].as_f64(),
        sample["node"]["utilisation"]["cpu_ns"].as_f64()
    );
    assert!(dom["cpu"].as_f64().unwrap() > 0.0, "load but no CPU use");
    assert_eq!(dom["node_iops"].as_f64(), sample["node"]["iops"].as_f64());
    assert_eq!(dom["rows"]["acme-data"]["tenant"], "acme");
    // The promise audit's column: a volume without a baseline has no promise; one with a
    // baseline and no demand was never short.
    assert_eq!(dom["rows"]["busy"]["promise"], "–");
    assert_eq!(dom["rows"]["idle"]["promise"], "kept");
    assert_eq!(
        dom["rows"]["idle"]["promise_short_seconds"].as_f64(),
        Some(0.0)
    );

    // 2. Close to fio's fixed rate (±25 %: fio catches up after a stall on a busy machine,
    //    and one second is a short window).
    let busy = dom["rows"]["busy"]["iops"].as_f64().unwrap();
    assert!(
        close(busy, BUSY_IOPS as f64, BUSY_IOPS as f64 * 0.25),
        "busy shows {busy} IOPS, fio runs {BUSY_IOPS}"
    );
    // 3. Close to the credit volume's own counters over the same seconds (±25 %: the windows
    //    differ by up to a sample), and never above its ceiling.
    let credit = dom["rows"]["credit"]["iops"].as_f64().unwrap();
    let counted = (ios_after.1 - ios_before.1) as f64
        / ios_after.0.duration_since(ios_before.0).as_secs_f64();
    assert!(
        close(credit, counted, counted * 0.25),
        "credit shows {credit} IOPS, its counters say {counted:.0}"
    );
    assert!(
        credit <= CREDIT_CEILING_IOPS * 1.05,
        "credit at {credit} IOPS"
    );

    // Bursting and lending: the unlimited volume runs on spare capacity, the QEMU class on
    // credits; the idle volume lends its whole baseline.
    let names = |list: &Value| -> Vec<String> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    let bursting = names(&dom["bursting"]);
    assert!(
        bursting.contains(&"busy".to_string()) && bursting.contains(&"credit".to_string()),
        "bursting: {bursting:?}"
    );
    assert_eq!(dom["rows"]["busy"]["phase"], "burst");
    let idle = dom["lending"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "idle")
        .unwrap_or_else(|| panic!("idle not lending: {}", dom["lending"]));
    assert_eq!(idle["unused_iops"].as_f64(), Some(IDLE_BASELINE_IOPS));
    assert!(
        !names(&dom["lending"]).contains(&"busy".to_string()),
        "an unlimited volume has no baseline to lend"
    );

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    browser.screenshot(&shot);
    println!("dashboard screenshot: {}", shot.display());

    // A wrong token: the API refuses it, and the page says 401 clearly.
    let (status, _) = get_with(&format!("{}/v1/stats", server.api), "wrong-token");
    assert_eq!(status, 401, "the API took a wrong token");
    browser.navigate(&format!("{}/#token=wrong-token", server.api));
    let message = wait_for("the 401 message", Duration::from_secs(20), || {
        let dom = read_dom(&browser);
        (dom["message"]["kind"] == "unauthorized").then(|| dom["message"]["text"].clone())
    });
    assert!(
        message.as_str().unwrap().contains("401"),
        "message: {message}"
    );
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-401.png");
    browser.screenshot(&shot);
    println!("401 screenshot: {}", shot.display());
    drop(browser);
    server.stop();
}

#[test]
fn stats_reject_out_of_range_queries() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    for query in [
        "seconds=0",
        "seconds=601",
        "limit=0",
        "limit=10001",
        "seconds=x",
        "bogus=1",
    ] {
        let (status, body) = get_with(&format!("{}/v1/stats?{query}", server.api), TEST_TOKEN);
        assert_eq!(status, 400, "{query}: {body}");
        assert_eq!(body["kind"], "invalid_query", "{query}: {body}");
    }
    let (status, body) = get_with(&format!("{}/assets/nope.js", server.api), TEST_TOKEN);
    assert_eq!(status, 404, "{body}");
    server.stop();
}

#[test]
fn stats_without_a_scheduler_say_why_numbers_are_missing() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        &dir.path().join("mem"),
        &["--memory", "1GiB", "--policy", "off"],
    );
    server.create_volume("plain", "64MiB");
    let rate = format!("--rate_iops={BUSY_IOPS}");
    let _load = Load::start(
        &[(
            server.uri("plain"),
            &["--rw=randread", "--iodepth=4", rate.as_str()][..],
        )],
        60,
    );
    // Rates come from the per-op stats, which run without a scheduler: wait for a sample in
    // which fio's rate shows.
    let stats = wait_for("a sample with fio's rate", Duration::from_secs(20), || {
        let stats = api_get(&server, "/v1/stats?seconds=5");
        let iops = stats["volumes"].as_array()?.first()?["iops"].as_f64()?;
        close(iops, BUSY_IOPS as f64, BUSY_IOPS as f64 * 0.25).then_some(stats)
    });
    assert_eq!(stats["policy"], "off");
    assert_eq!(stats["scheduler"], false);
    assert!(
        stats["note"]
            .as_str()
            .is_some_and(|n| n.contains("no scheduler"))
    );
    let volume = &stats["volumes"][0];
    assert_eq!(volume["name"], "plain");
    // What only a scheduler knows stays null.
    assert!(
        volume["credits"].is_null() && volume["phase_iops"].is_null(),
        "{volume}"
    );
    assert!(
        volume["latency_us_mean"]
            .as_f64()
            .is_some_and(|us| us > 0.0)
            && volume["latency_us_p99"].as_f64().is_some_and(|us| us > 0.0),
        "{volume}"
    );
    let out = server.cli(&["top", "--once"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no scheduler"));
    server.stop();
}

#[test]
fn top_once_prints_the_loaded_volumes_busiest_first() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (server, _load) = loaded_server(dir.path());
    // Wait until the sampler has seen both loads, busy at its rate (the API, not the command
    // under test): a sample of fio's first second may catch it ramping up.
    wait_for("a sample with both loads", Duration::from_secs(30), || {
        let stats = api_get(&server, "/v1/stats?seconds=1");
        let rows = stats["volumes"].as_array()?.clone();
        let iops = |name: &str| {
            rows.iter()
                .find(|v| v["name"] == name)
                .and_then(|v| v["iops"].as_f64())
                .unwrap_or(0.0)
        };
        let busy_at_rate = close(iops("busy"), BUSY_IOPS as f64, BUSY_IOPS as f64 * 0.25);
        (busy_at_rate && iops("credit") > 0.0).then_some(())
    });

    let out = server.cli(&["top", "--once"]);
    assert!(out.status.success(), "{}", text(&out));
    let frame = String::from_utf8_lossy(&out.stdout).to_string();
    println!("{frame}");
    assert!(!frame.contains('\x1b'), "--once into a pipe has no escapes");
    let lines: Vec<&str> = frame.lines().collect();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("node") && l.contains("cpu")),
        "no node line:\n{frame}"
    );
    let header = lines
        .iter()
        .position(|l| l.split_whitespace().next() == Some("VOLUME"))
        .unwrap_or_else(|| panic!("no header:\n{frame}"));
    assert_eq!(
        lines[header].split_whitespace().collect::<Vec<_>>(),
        [
            "VOLUME", "TENANT", "IOPS", "MB/s", "LATENCY", "QUEUE", "CREDITS", "PHASE", "BASELINE"
        ]
    );
    let rows: Vec<Vec<&str>> = lines[header + 1..]
        .iter()
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    let order: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(order.len(), 4, "{frame}");
    // busy runs 2,000 IOPS, credit at most 1,600: busiest first, the idle ones after.
    assert_eq!(&order[..2], ["busy", "credit"], "{frame}");
    let iops = |row: &Vec<&str>| row[2].replace(',', "").parse::<f64>().unwrap();
    assert!(
        close(iops(&rows[0]), BUSY_IOPS as f64, BUSY_IOPS as f64 * 0.25),
        "{frame}"
    );
    assert!(iops(&rows[1]) > 0.0 && iops(&rows[1]) <= CREDIT_CEILING_IOPS * 1.05);
    let acme = rows.iter().find(|r| r[0] == "acme-data").unwrap();
    assert_eq!(acme[1], "acme");
    assert!(
        frame.contains("lending") && frame.contains("idle"),
        "{frame}"
    );

    // --json: the /v1/stats document, one per line.
    let out = server.cli(&["top", "--once", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("one JSON document");
    assert_eq!(doc["policy"], "burst");
    assert!(doc["volumes"].as_array().is_some_and(|v| v.len() == 4));

    // An unreachable API: exit code 4.
    let out = Command::new(common::BIN)
        .args(["top", "--once", "--api", "http://127.0.0.1:9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    server.stop();
}
