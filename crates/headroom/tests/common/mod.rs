//! Shared harness for the end-to-end tests: starts the real `headroom` binary on free loopback
//! ports, learns its addresses from the line it prints, drives it with real clients, and stops
//! it by PID (SIGTERM for a clean stop, SIGKILL to simulate a crash). The one HTTP client of
//! the tests' API calls is here too ([`api_get`], [`api_post`], [`api_patch`], [`agent`]).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod guest;
pub mod openmetrics;
pub mod raw;

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_headroom");

/// The management API's bearer token every test server is started with (`HEADROOM_TOKEN`);
/// the CLI gets it the same way, and direct HTTP requests send `Authorization: Bearer` it.
pub const TEST_TOKEN: &str = "headroom-test-token-0123456789abcdef";

/// The `Authorization` header value direct HTTP requests send: `Bearer TEST_TOKEN`.
pub fn bearer() -> String {
    format!("Bearer {TEST_TOKEN}")
}

/// An HTTP client for tests that read error statuses themselves (4xx/5xx are answers, not
/// errors), bounded at 60 s per request so a stuck server fails the test instead of hanging it.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(60)))
        .build()
        .into()
}

/// The JSON answer of a 2xx response to a request on the server's API; panics with the
/// status and body otherwise (tests that read error statuses use [`agent`] themselves).
fn api_answer(
    what: &str,
    answer: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> serde_json::Value {
    let mut response = answer.unwrap_or_else(|err| panic!("{what}: {err}"));
    let status = response.status();
    let body = response.body_mut().read_to_string().unwrap_or_default();
    assert!(status.is_success(), "{what}: {status} {body}");
    serde_json::from_str(&body).unwrap_or_else(|err| panic!("{what}: {err}: {body}"))
}

/// `GET path` on the server's API with the test token: the JSON body of its 2xx answer.
pub fn api_get(server: &Server, path: &str) -> serde_json::Value {
    let answer = agent()
        .get(format!("{}{path}", server.api))
        .header("authorization", bearer())
        .call();
    api_answer(&format!("GET {path}"), answer)
}

/// `POST path` with the JSON `body` and the test token: the JSON body of its 2xx answer.
pub fn api_post(server: &Server, path: &str, body: serde_json::Value) -> serde_json::Value {
    let answer = agent()
        .post(format!("{}{path}", server.api))
        .header("authorization", bearer())
        .send_json(&body);
    api_answer(&format!("POST {path} {body}"), answer)
}

/// `PATCH path` with the JSON `body` and the test token: the JSON body of its 2xx answer.
pub fn api_patch(server: &Server, path: &str, body: serde_json::Value) -> serde_json::Value {
    let answer = agent()
        .patch(format!("{}{path}", server.api))
        .header("authorization", bearer())
        .send_json(&body);
    api_answer(&format!("PATCH {path} {body}"), answer)
}

/// Writes a test's measured numbers to the process's standard error directly, past the test
/// harness's capture, so that every CI log shows them (the acceptance runs print their
/// numbers), not only the logs of failed tests.
pub fn report(text: &str) {
    use std::io::Write as _;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{text}");
}

/// The Prometheus text of the server whose API is at `api` (with the test token).
pub fn metrics_text(api: &str) -> String {
    agent()
        .get(format!("{api}/metrics"))
        .header("authorization", bearer())
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap()
}

/// True when `tool` is on PATH. When it is missing the test is skipped with a message, unless
/// HEADROOM_REQUIRE_TOOLS is set (CI), where a missing tool fails the test.
pub fn have_tool(tool: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false);
    if !found {
        if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
            panic!("{tool} is required (HEADROOM_REQUIRE_TOOLS is set) but not installed");
        }
        eprintln!("SKIPPED: {tool} is not installed (scripts/test installs it)");
    }
    found
}

pub struct Server {
    child: Option<Child>,
    pub nbd: SocketAddr,
    pub api: String,
    pub data_dir: PathBuf,
    pub log_path: PathBuf,
}

impl Server {
    /// Starts a file-backed server on `data_dir` (small device files so tests stay light).
    pub fn start(data_dir: &Path) -> Server {
        Self::start_with(data_dir, &["--devices", "2", "--device-size", "4GiB"])
    }

    /// Starts a memory-backed server; `data_dir` only holds its log.
    pub fn start_memory(data_dir: &Path, capacity: &str) -> Server {
        Self::start_with(data_dir, &["--memory", capacity])
    }

    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Server {
        Self::start_wrapped(data_dir, &[], extra)
    }

    /// Starts the server through `wrapper` (a command that execs its arguments, such as
    /// `prlimit --nofile=64:64 --`), so the PID is still the server's.
    pub fn start_wrapped(data_dir: &Path, wrapper: &[&str], extra: &[&str]) -> Server {
        Self::start_full(data_dir, wrapper, extra, Some(TEST_TOKEN))
    }

    /// Starts a server without HEADROOM_TOKEN in its environment: it takes its token from the
    /// configuration or the data directory's token file (`api-token`).
    pub fn start_without_token(data_dir: &Path, extra: &[&str]) -> Server {
        Self::start_full(data_dir, &[], extra, None)
    }

    fn start_full(
        data_dir: &Path,
        wrapper: &[&str],
        extra: &[&str],
        token: Option<&str>,
    ) -> Server {
        std::fs::create_dir_all(data_dir).expect("create data dir");
        let log_path = data_dir.with_extension("log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open log");
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(BIN);
                command
            }
            None => Command::new(BIN),
        };
        match token {
            Some(token) => command.env("HEADROOM_TOKEN", token),
            None => command.env_remove("HEADROOM_TOKEN"),
        };
        let mut child = command
            .arg("serve")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
            .args(extra)
            .env("HEADROOM_LOG", "debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn headroom serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        // Blocks until the server has bound both ports and printed them (or exited).
        let ready = loop {
            match lines.next() {
                Some(Ok(line)) if line.starts_with("nbd://") => break line,
                Some(Ok(_)) => continue,
                _ => {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    panic!("server exited before it was ready; log:\n{log}");
                }
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let mut parts = ready.split_whitespace();
        let nbd = parts
            .next()
            .and_then(|s| s.strip_prefix("nbd://"))
            .and_then(|s| s.parse().ok())
            .expect("nbd address");
        let api = parts.nth(1).expect("api url").to_string();
        Server {
            child: Some(child),
            nbd,
            api,
            data_dir: data_dir.to_path_buf(),
            log_path,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// `nbd://127.0.0.1:PORT/EXPORT`
    pub fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{}", self.nbd, export)
    }

    /// Runs the CLI against this server's API.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("HEADROOM_API", &self.api)
            .env("HEADROOM_TOKEN", TEST_TOKEN)
            .output()
            .expect("run headroom CLI")
    }

    /// `tenant create ID` (a volume can only name a tenant that exists).
    pub fn create_tenant(&self, id: &str) {
        let out = self.cli(&["tenant", "create", id]);
        assert!(out.status.success(), "tenant create failed: {}", text(&out));
    }

    pub fn create_volume(&self, name: &str, size: &str) {
        self.create_volume_with(name, size, &[]);
    }

    /// `volume create NAME --size SIZE` with more flags (`--tenant ID`, `--read-only`, QoS).
    pub fn create_volume_with(&self, name: &str, size: &str, flags: &[&str]) {
        let out = self.cli(&[&["volume", "create", name, "--size", size], flags].concat());
        assert!(out.status.success(), "volume create failed: {}", text(&out));
    }

    /// SIGTERM and wait: the server must exit 0 after flushing.
    pub fn stop(mut self) {
        let mut child = self.child.take().expect("running");
        signal(child.id(), "TERM");
        let status = child.wait().expect("wait");
        assert!(
            status.success(),
            "server exited with {status} after SIGTERM; log:\n{}",
            self.log()
        );
    }

    /// SIGTERM and wait at most `limit` for the exit (SIGKILL and panic past it); returns the
    /// status and how long the exit took.
    pub fn stop_within(
        mut self,
        limit: std::time::Duration,
    ) -> (std::process::ExitStatus, std::time::Duration) {
        let mut child = self.child.take().expect("running");
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        let started = std::time::Instant::now();
        signal(pid, "TERM");
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        match rx.recv_timeout(limit) {
            Ok(status) => (status.expect("wait"), started.elapsed()),
            Err(_) => {
                signal(pid, "KILL");
                panic!(
                    "the server did not exit within {limit:?} of SIGTERM; log:\n{}",
                    self.log()
                );
            }
        }
    }

    /// SIGTERM and wait for the exit, whatever its status (a server with a failed device
    /// exits non-zero because it cannot flush); returns the status.
    pub fn stop_any(mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), "TERM");
        child.wait().expect("wait")
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(mut self) {
        let mut child = self.child.take().expect("running");
        signal(child.id(), "KILL");
        let _ = child.wait();
    }

    /// The exit status once the process has ended (`None` while it runs).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|child| child.try_wait().ok().flatten())
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "KILL");
            let _ = child.wait();
        }
    }
}

pub fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status();
}

/// fio's whole JSON report (`--output-format=json`) from its stdout: the nbd engine may print
/// lines before the JSON.
pub fn fio_report(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let start = stdout
        .find('{')
        .unwrap_or_else(|| panic!("no JSON from fio: {}", text(out)));
    serde_json::from_str(&stdout[start..])
        .unwrap_or_else(|e| panic!("fio json: {e}: {}", text(out)))
}

/// The report of fio's first (or only) job.
pub fn fio_job(out: &Output) -> serde_json::Value {
    fio_report(out)["jobs"][0].clone()
}

/// fio's crc32c-verified `rw` (`randwrite` or `randrw`) over NBD at `uri`: two jobs at QD32,
/// 4 KiB to 1 MiB, 48 MiB each 64 MiB apart; fails on any error, on nothing written, and (for
/// `randwrite`) on a verification that read back less than was written.
pub fn fio_verify(uri: &str, rw: &str) {
    let out = Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            "--bsrange=4k-1m",
            "--iodepth=32",
            "--numjobs=2",
            "--size=48m",
            "--offset_increment=64m",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            // No verify-state files in the working directory (they are test output).
            "--verify_state_save=0",
            "--group_reporting",
            "--output-format=json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "fio {rw} failed: {}", text(&out));
    let job = fio_job(&out);
    assert_eq!(job["error"].as_u64(), Some(0), "{job}");
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    assert!(written > 0, "fio wrote nothing: {job}");
    if rw == "randwrite" {
        // Verification re-reads everything written.
        let read = job["read"]["io_bytes"].as_u64().unwrap();
        assert!(read >= written, "verify read {read} < written {written}");
    }
}

/// stdout and stderr of a finished command, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command and asserts it succeeded.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|err| panic!("running {cmd:?}: {err}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", text(&out));
    out
}

/// A file of `size_bytes` deterministic pseudo-random bytes (xorshift; incompressible enough).
pub fn random_file(path: &Path, size_bytes: usize, seed: u64) {
    let mut state = seed | 1;
    let mut data = vec![0u8; size_bytes];
    for chunk in data.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let bytes = state.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    std::fs::write(path, data).expect("write random file");
}

/// Starts `serve` with `extra` and expects it to exit before it is ready. Returns its stderr.
/// (Reads stdout to its end: a server that wrongly starts prints its ready line, is killed
/// and fails the test, so nothing waits on a timer.)
pub fn start_fails(dir: &Path, extra: &[&str]) -> String {
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--data-dir")
        .arg(dir)
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn headroom serve");
    let stdout = child.stdout.take().expect("stdout");
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap_or_default();
        if line.starts_with("nbd://") {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve {extra:?} started: {line}");
        }
    }
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    let status = child.wait().expect("wait");
    assert_eq!(
        status.code(),
        Some(1),
        "serve {extra:?}: {status}\n{stderr}"
    );
    stderr
}
