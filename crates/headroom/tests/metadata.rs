//! End-to-end: the metadata of the real server on a really full file system (a small tmpfs
//! mounted for the test: needs root, skipped otherwise and failing under
//! HEADROOM_REQUIRE_TOOLS=1). `/readyz` (public, no token) answers 200 while metadata
//! commits work; when the disk fills, a metadata commit still succeeds inside the metadata
//! reserve and `/readyz` answers 503 naming the reserve; once space is freed it answers 200
//! again; and the server restarts on a disk that is still full and serves its data.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{BIN, Server, agent, have_tool, random_file, run_ok};
use serde_json::Value;

/// A tmpfs of `size_bytes` mounted on `dir`, unmounted on drop.
struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    fn mount(dir: &Path, size_bytes: u64) -> Option<SmallFs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_bytes}"), "tmpfs"])
            .arg(dir)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
                panic!("mounting a tmpfs is required (HEADROOM_REQUIRE_TOOLS is set) but failed");
            }
            eprintln!("SKIPPED: cannot mount a tmpfs (needs root) for a really full disk");
            return None;
        }
        Some(SmallFs {
            dir: dir.to_path_buf(),
        })
    }

    /// Takes every free byte with a filler file.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let filler = self.dir.join("filler");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&filler)
            .unwrap();
        let chunk = vec![0xA5u8; 64 << 10];
        let mut w = &f;
        while w.write_all(&chunk).is_ok() {}
        while w.write_all(&chunk[..4096]).is_ok() {}
        filler
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// `GET /readyz` without a token: status and body.
fn readyz(server: &Server) -> (u16, Value) {
    let mut response = agent()
        .get(&format!("{}/readyz", server.api))
        .call()
        .unwrap();
    let status = response.status().as_u16();
    let body: Value = serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    (status, body)
}

#[test]
fn readyz_follows_a_full_disk_and_the_node_restarts_on_it() {
    if !have_tool("nbdcopy") || !have_tool("cmp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = SmallFs::mount(&dir.path().join("fs"), 64 << 20) else {
        return;
    };
    let config = dir.path().join("headroom.toml");
    std::fs::write(&config, "[storage]\nmetadata_reserve = \"8MiB\"\n").unwrap();
    let config = config.to_str().unwrap();
    let args = [
        "--config",
        config,
        "--devices",
        "1",
        "--device-size",
        "256MiB",
    ];
    let data_dir = fs.dir.join("data");
    let server = Server::start_with(&data_dir, &args);
    let (status, body) = readyz(&server);
    assert_eq!(
        (status, &body),
        (200, &serde_json::json!({"status": "ready", "reasons": []}))
    );

    let image = dir.path().join("image.raw");
    random_file(&image, 4 << 20, 9);
    server.create_volume("v", "16MiB");
    run_ok(
        Command::new("nbdcopy")
            .arg("--flush")
            .arg(&image)
            .arg(server.uri("v")),
    );

    // The disk fills up; a management change still commits, inside the reserve.
    let filler = fs.fill();
    server.create_volume("w", "16MiB");
    let (status, body) = readyz(&server);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "not_ready");
    let reasons = body["reasons"].as_array().unwrap();
    assert!(
        reasons.len() == 1
            && reasons[0]
                .as_str()
                .unwrap()
                .starts_with("metadata reserve in use: the disk is full"),
        "{body}"
    );
    // Liveness is unaffected.
    let response = agent()
        .get(&format!("{}/healthz", server.api))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);

    // Space comes back: ready again without a restart.
    std::fs::remove_file(&filler).unwrap();
    let (status, body) = readyz(&server);
    assert_eq!(status, 200, "{body}");
    server.stop();

    // Full again while the node is down: it starts (its open commits, inside the reserve
    // if it must) and serves the data.
    let _filler = fs.fill();
    let server = Server::start_with(&data_dir, &args);
    let back = dir.path().join("back.raw");
    run_ok(Command::new("nbdcopy").arg(server.uri("v")).arg(&back));
    run_ok(
        Command::new("cmp")
            .args(["-n", &(4u64 << 20).to_string()])
            .arg(&image)
            .arg(&back),
    );
    server.stop();
}

/// `headroom check` on the data directory: exit code and stdout.
fn check(data_dir: &Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new(BIN)
        .arg("check")
        .arg("--data-dir")
        .arg(data_dir)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn a_damaged_meta_redb_stops_the_start_and_check_repair_restores_it() {
    if !have_tool("nbdcopy") || !have_tool("cmp") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let args = ["--devices", "2", "--device-size", "256MiB"];
    let server = Server::start_with(&data_dir, &args);
    let image = dir.path().join("image.raw");
    random_file(&image, 6 << 20, 5);
    server.create_volume("v", "8MiB");
    run_ok(
        Command::new("nbdcopy")
            .arg("--flush")
            .arg(&image)
            .arg(server.uri("v")),
    );
    // Refused while the server runs: redb's lock.
    let (code, _) = check(&data_dir, &[]);
    assert_eq!(code, 2);
    server.stop();
    let (code, out) = check(&data_dir, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("clean"), "{out}");

    // The first page (header and commit slots) overwritten.
    let meta = data_dir.join("meta.redb");
    let mut bytes = std::fs::read(&meta).unwrap();
    bytes[..4096].fill(0x5A);
    std::fs::write(&meta, bytes).unwrap();
    let out = Command::new(BIN)
        .arg("serve")
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .args(args)
        .env("HEADROOM_TOKEN", common::TEST_TOKEN)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started on a damaged meta.redb");
    assert!(
        stderr.contains("meta.redb is damaged") && stderr.contains("headroom check --data-dir"),
        "{stderr}"
    );
    // Said once, not once per layer of the error chain.
    assert_eq!(stderr.matches("is damaged").count(), 1, "{stderr}");
    let (code, out) = check(&data_dir, &["--json"]);
    assert_eq!(code, 1, "{out}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["files"][0]["state"], "damaged", "{report}");
    let (code, out) = check(&data_dir, &["--repair"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("repaired: restored"), "{out}");

    let server = Server::start_with(&data_dir, &args);
    let back = dir.path().join("back.raw");
    run_ok(Command::new("nbdcopy").arg(server.uri("v")).arg(&back));
    run_ok(
        Command::new("cmp")
            .args(["-n", &(6u64 << 20).to_string()])
            .arg(&image)
            .arg(&back),
    );
    server.stop();
}
