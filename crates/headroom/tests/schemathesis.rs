//! schemathesis (property-based testing from the OpenAPI document) against a real
//! `headroom serve`: it reads the served `/openapi.json`, generates requests for every
//! operation in it (valid ones from the schemas, and invalid ones: wrong types, missing fields,
//! odd path parameters) and sends them with the bootstrap token. It fails on any 5xx
//! (`not_a_server_error`), a status the document does not list for the operation
//! (`status_code_conformance`), a content type or a body that is not the documented one
//! (`content_type_conformance`, `response_schema_conformance`), and an error without the API's
//! JSON error body (`error_has_json_body`, our own check in `schemathesis/headroom_checks.py`).
//!
//! The server is a throwaway one on the memory store (two 256 MiB RAM devices), so the
//! destructive operations (DELETE, device fail) cost nothing. Bounded: at most
//! [`MAX_EXAMPLES`] requests per operation and phase, a fixed seed (a CI failure reproduces),
//! and [`MAX_TIME_S`] for the whole run.
//!
//! schemathesis is installed from PyPI into a virtual environment under the target directory
//! (`CARGO_TARGET_TMPDIR/schemathesis-venv-VERSION`, kept across runs; pip's own cache makes a
//! fresh clone's install quick). Without python3, its `venv` module or PyPI the test skips,
//! and fails under HEADROOM_REQUIRE_TOOLS.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, TEST_TOKEN};

/// The schemathesis release the test runs (pinned: a new release may add checks).
const SCHEMATHESIS_VERSION: &str = "4.32.5";
/// Requests per operation and phase at most.
const MAX_EXAMPLES: u32 = 12;
/// The whole run's time budget (schemathesis stops generating when it is spent).
const MAX_TIME_S: u64 = 45;
/// Past this the run is killed and the test fails (a hung server, not a slow one).
const KILL_AFTER: Duration = Duration::from_secs(180);
/// The generator's seed: the same requests every run.
const SEED: u64 = 20_260_101;

const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,\
                      response_schema_conformance,error_has_json_body";

/// Skips (with the reason) or, under HEADROOM_REQUIRE_TOOLS, fails.
fn unavailable(reason: &str) -> Option<PathBuf> {
    if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
        panic!("schemathesis is required (HEADROOM_REQUIRE_TOOLS is set): {reason}");
    }
    eprintln!("SKIPPED: schemathesis is unavailable: {reason}");
    None
}

/// The `schemathesis` executable of the test's virtual environment, installed if missing.
fn schemathesis() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("schemathesis-venv-{SCHEMATHESIS_VERSION}"));
    let bin = venv.join("bin/schemathesis");
    // Written last: a venv without it is a half-finished install, made again.
    let marker = venv.join("installed");
    if marker.exists() && bin.exists() {
        return Some(bin);
    }
    if !common::have_tool("python3") {
        return None;
    }
    let _ = std::fs::remove_dir_all(&venv);
    let made = Command::new("python3")
        .arg("-m")
        .arg("venv")
        .arg(&venv)
        .output()
        .expect("run python3 -m venv");
    if !made.status.success() {
        return unavailable(&format!(
            "python3 -m venv failed (install python3-venv): {}",
            String::from_utf8_lossy(&made.stderr)
        ));
    }
    let started = Instant::now();
    let installed = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!("schemathesis=={SCHEMATHESIS_VERSION}"))
        .output()
        .expect("run pip");
    if !installed.status.success() {
        return unavailable(&format!(
            "pip install schemathesis=={SCHEMATHESIS_VERSION} failed: {}",
            String::from_utf8_lossy(&installed.stderr)
        ));
    }
    eprintln!(
        "installed schemathesis {SCHEMATHESIS_VERSION} in {} ({:.0} s)",
        venv.display(),
        started.elapsed().as_secs_f64()
    );
    std::fs::write(&marker, SCHEMATHESIS_VERSION).expect("write the venv marker");
    Some(bin)
}

#[test]
fn the_served_api_conforms_to_its_openapi_document() {
    let Some(schemathesis) = schemathesis() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "512MiB");
    let hooks_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis");
    let report = dir.path().join("report");
    let started = Instant::now();
    let mut child = Command::new(&schemathesis)
        .arg("run")
        .arg(format!("{}/openapi.json", server.api))
        .args(["--header", &format!("Authorization: Bearer {TEST_TOKEN}")])
        .args(["--checks", CHECKS])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--max-time", &MAX_TIME_S.to_string()])
        .args(["--seed", &SEED.to_string()])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--workers", "1", "--request-timeout", "10"])
        .args(["--no-color", "--report-dir"])
        .arg(&report)
        // It keeps a cache (`.schemathesis/`) in its working directory: not in the tree.
        .current_dir(dir.path())
        .env("SCHEMATHESIS_HOOKS", "headroom_checks")
        .env("PYTHONPATH", &hooks_dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run schemathesis");
    // Read the output on threads so a full pipe never stalls the run; poll for its end.
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).ok();
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut text).ok();
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > KILL_AFTER {
            child.kill().ok();
            let status = child.wait().unwrap();
            eprintln!("schemathesis killed after {KILL_AFTER:?}");
            break status;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = out.join().unwrap();
    let stderr = err.join().unwrap();
    eprintln!(
        "schemathesis {SCHEMATHESIS_VERSION} ran {:.0} s:\n{stdout}\n{stderr}",
        started.elapsed().as_secs_f64()
    );
    let log = server.log();
    server.stop();
    assert!(
        status.success(),
        "schemathesis found problems ({status}); the server's log:\n{}",
        log.get(log.len().saturating_sub(20_000)..).unwrap_or(&log)
    );
    // It ran the operations, not nothing: the summary counts the operations tested.
    assert!(
        stdout.contains("operations") || stdout.contains("Operations"),
        "no summary of tested operations:\n{stdout}"
    );
}
