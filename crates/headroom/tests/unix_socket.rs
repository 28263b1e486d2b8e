//! End-to-end: NBD over the Unix socket (`serve --nbd-unix PATH`) with the real clients a KVM
//! host uses — nbdinfo and fio (libnbd's `nbd+unix://` URIs), qemu-img and qemu-io (QEMU's
//! own NBD client) — against the real server binary: data written over the socket and read
//! back over TCP, fio's verified writes, the uid → tenant map, TCP turned off, TLS over the
//! socket, and the socket file's life (mode, a stale one replaced after a kill, a regular
//! file refused and kept, removed at a clean stop).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{Server, fio_verify, have_tool, random_file, run_ok, start_fails, text};
use serde_json::Value;

/// This process's uid: the one the server reads off our connections (`SO_PEERCRED`).
fn our_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

fn unix_uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// A memory server with TCP on a free port and the Unix socket at `socket`, plus `extra`.
fn server_with_socket(dir: &Path, socket: &Path, extra: &[&str]) -> Server {
    let mut args = vec!["--memory", "1GiB", "--nbd-unix", socket.to_str().unwrap()];
    args.extend_from_slice(extra);
    Server::start_with(&dir.join("mem"), &args)
}

/// `nbdinfo --list --json` at `uri`: the export names, sorted.
fn listed(uri: &str) -> Vec<String> {
    let out = run_ok(Command::new("nbdinfo").args(["--list", "--json", uri]));
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut names: Vec<String> = listing["exports"]
        .as_array()
        .map(|exports| {
            exports
                .iter()
                .map(|e| e["export-name"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn nbdinfo_and_qemu_write_over_the_socket_and_tcp_reads_the_same_bytes() {
    if !have_tool("nbdinfo") || !have_tool("qemu-io") || !have_tool("qemu-img") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let server = server_with_socket(dir.path(), &socket, &["--nbd-unix-mode", "0660"]);
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    server.create_volume("vm1", "64MiB");

    let out = run_ok(Command::new("nbdinfo").args(["--json", &unix_uri(&socket, "vm1")]));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["exports"][0]["export-size"].as_u64(), Some(64 << 20));
    assert_eq!(info["protocol"].as_str(), Some("newstyle-fixed"));

    // qemu-img writes a random image over the socket; qemu-io checks a pattern over it.
    let image = dir.path().join("random.raw");
    random_file(&image, 16 << 20, 7);
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&image)
            .arg(unix_uri(&socket, "vm1")),
    );
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5a 32M 1M",
        "-c",
        "read -P 0x5a 32M 1M",
        &unix_uri(&socket, "vm1"),
    ]));
    // Read back over TCP: one volume, two doors.
    let back = dir.path().join("back.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &server.uri("vm1")])
            .arg(&back),
    );
    let back = std::fs::read(&back).unwrap();
    assert!(
        back[..16 << 20] == std::fs::read(&image).unwrap()[..],
        "the image differs"
    );
    assert!(back[32 << 20..33 << 20].iter().all(|&b| b == 0x5a));
    let out = run_ok(Command::new("qemu-img").args(["info", &unix_uri(&socket, "vm1")]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("64 MiB"),
        "{}",
        text(&out)
    );

    server.stop();
    assert!(
        std::fs::symlink_metadata(&socket).is_err(),
        "the socket file is removed at a clean stop"
    );
}

#[test]
fn fio_verified_writes_over_the_socket() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let server = server_with_socket(dir.path(), &socket, &[]);
    server.create_volume("fio", "128MiB");
    for rw in ["randwrite", "randrw"] {
        fio_verify(&unix_uri(&socket, "fio"), rw);
    }
    server.stop();
}

#[test]
fn a_mapped_uid_is_its_tenant_and_tcp_from_the_same_host_is_not() {
    if !have_tool("nbdinfo") || !have_tool("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let mapping = format!("{}=alice", our_uid());
    let server = server_with_socket(dir.path(), &socket, &["--nbd-unix-tenant", &mapping]);
    server.create_tenant("alice");
    server.create_volume_with("alices", "16MiB", &["--tenant", "alice"]);
    server.create_volume("public", "16MiB");

    assert_eq!(listed(&unix_uri(&socket, "")), ["alices"]);
    assert_eq!(listed(&server.uri("")), ["public"]);
    // Alice's volume opens over the socket, and is unknown over TCP.
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x11 0 64k",
        &unix_uri(&socket, "alices"),
    ]));
    let out = Command::new("nbdinfo")
        .arg(server.uri("alices"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "TCP opened alice's volume: {}",
        text(&out)
    );
    // And the public volume is not alice's to open over the socket.
    let out = Command::new("nbdinfo")
        .arg(unix_uri(&socket, "public"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "alice opened the public volume: {}",
        text(&out)
    );
    server.stop();

    // Unmapped (another uid mapped, not ours): anonymous, like TCP.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let other = format!("{}=alice", our_uid() + 1);
    let server = server_with_socket(dir.path(), &socket, &["--nbd-unix-tenant", &other]);
    server.create_tenant("alice");
    server.create_volume_with("alices", "16MiB", &["--tenant", "alice"]);
    server.create_volume("public", "16MiB");
    assert_eq!(listed(&unix_uri(&socket, "")), ["public"]);
    server.stop();
}

/// `serve` with TCP off: the ready line names the socket; returns the child and the API URL.
fn start_unix_only(dir: &Path, socket: &Path) -> (std::process::Child, String) {
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let mut child = Command::new(common::BIN)
        .args(["serve", "--memory", "1GiB", "--nbd-listen", "off"])
        .args(["--api-listen", "127.0.0.1:0", "--nbd-unix"])
        .arg(socket)
        .env("HEADROOM_TOKEN", common::TEST_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let ready = lines
        .next()
        .expect("a ready line")
        .expect("readable stdout");
    std::thread::spawn(move || for _ in lines {});
    let expected = format!("nbd+unix:///?socket={}  api http://", socket.display());
    assert!(ready.starts_with(&expected), "{ready}");
    let api = ready.split_whitespace().nth(2).unwrap().to_string();
    (child, api)
}

#[test]
fn tcp_off_serves_the_socket_alone() {
    if !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let (mut child, api) = start_unix_only(dir.path(), &socket);
    let out = Command::new(common::BIN)
        .args(["volume", "create", "v", "--size", "8MiB"])
        .env("HEADROOM_API", &api)
        .env("HEADROOM_TOKEN", common::TEST_TOKEN)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(listed(&unix_uri(&socket, "")), ["v"]);
    // The API says where NBD is, and that TCP is off.
    let node: Value = common::agent()
        .get(format!("{api}/v1/node"))
        .header("authorization", common::bearer())
        .call()
        .unwrap()
        .body_mut()
        .read_json()
        .unwrap();
    assert_eq!(node["nbd_listen"], Value::Null, "{node}");
    assert_eq!(node["nbd_unix"].as_str(), socket.to_str(), "{node}");
    common::signal(child.id(), "TERM");
    assert!(child.wait().unwrap().success());
    assert!(
        std::fs::symlink_metadata(&socket).is_err(),
        "removed at a clean stop"
    );
}

#[test]
fn a_stale_socket_is_replaced_and_a_regular_file_is_refused_and_kept() {
    if !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let server = server_with_socket(dir.path(), &socket, &[]);
    server.kill9();
    assert!(
        std::fs::symlink_metadata(&socket)
            .unwrap()
            .file_type()
            .is_socket(),
        "a killed server leaves its socket behind"
    );
    // The next start replaces it and serves.
    let server = server_with_socket(dir.path(), &socket, &[]);
    server.create_volume("v", "8MiB");
    assert_eq!(listed(&unix_uri(&socket, "")), ["v"]);
    // A second server on the same path while the first listens: refused, the socket kept.
    let message = start_fails(
        &dir.path().join("second"),
        &["--memory", "1GiB", "--nbd-unix", socket.to_str().unwrap()],
    );
    assert!(
        message.contains("another process is listening"),
        "{message}"
    );
    assert_eq!(
        listed(&unix_uri(&socket, "")),
        ["v"],
        "the first still serves"
    );
    server.stop();

    // A regular file at the path: refused with a clear error, never unlinked.
    let image = dir.path().join("disk.img");
    std::fs::write(&image, b"an operator's disk image").unwrap();
    let message = start_fails(
        &dir.path().join("third"),
        &["--memory", "1GiB", "--nbd-unix", image.to_str().unwrap()],
    );
    assert!(message.contains("exists and is not a socket"), "{message}");
    assert_eq!(std::fs::read(&image).unwrap(), b"an operator's disk image");
}

#[test]
fn a_bad_mode_owner_or_map_is_refused_before_the_socket_exists() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let path = socket.to_str().unwrap();
    for (flags, expected) in [
        (
            vec!["--nbd-unix", path, "--nbd-unix-mode", "4777"],
            "0 to 0777",
        ),
        (
            vec!["--nbd-unix", path, "--nbd-unix-mode", "rw"],
            "octal mode",
        ),
        (
            vec!["--nbd-unix", path, "--nbd-unix-owner", "qemu"],
            "UID:GID",
        ),
        (
            vec!["--nbd-unix", path, "--nbd-unix-tenant", "qemu=alice"],
            "numeric uid",
        ),
        (vec!["--nbd-unix-mode", "0660"], "needs server.nbd_unix"),
        (vec!["--nbd-listen", "off"], "needs server.nbd_unix"),
    ] {
        // Flags clap refuses exit 2, values the configuration refuses 1; a server that
        // wrongly starts is killed by the timeout and fails the test.
        let out = Command::new("timeout")
            .args(["30", common::BIN, "serve", "--memory", "1GiB"])
            .args(["--api-listen", "127.0.0.1:0"])
            .args(if flags.contains(&"--nbd-listen") {
                &[][..]
            } else {
                &["--nbd-listen", "127.0.0.1:0"][..]
            })
            .args(&flags)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let message = text(&out);
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{flags:?}: {message}"
        );
        assert!(message.contains(expected), "{flags:?}: {message}");
        assert!(
            std::fs::symlink_metadata(&socket).is_err(),
            "{flags:?} left a socket file"
        );
    }
}

#[cfg(feature = "tls")]
mod with_tls {
    use std::path::PathBuf;
    use std::process::Output;

    use super::*;

    const KEY: &str = "7d1f4c0b9e3a2f68a1c5e9d0b4f7a3c26e8d1b5f9a0c4e7d2b6f8a1c3e5d7f90";

    fn psk_dir(root: &Path) -> PathBuf {
        let dir = root.join("psk");
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys.psk");
        std::fs::write(&keys, format!("alice:{KEY}\n")).unwrap();
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
        dir
    }

    fn qemu_img_info(socket: &Path, psk: &Path, export: &str) -> Output {
        let object = format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            psk.display()
        );
        let image = format!(
            "driver=nbd,server.type=unix,server.path={},export={export},tls-creds=tls0",
            socket.display()
        );
        Command::new("timeout")
            .args(["60", "qemu-img", "info", "--object", &object])
            .args(["--image-opts", &image])
            .output()
            .unwrap()
    }

    /// STARTTLS over the Unix socket with `--tls-required`: qemu-img (GnuTLS) and nbdinfo
    /// (`nbds+unix://`) get alice's volume by her PSK identity; a plaintext client is refused;
    /// a uid mapped to another tenant than the PSK's is refused rather than either winning.
    #[test]
    fn starttls_over_the_socket_and_a_uid_that_disagrees_with_the_identity() {
        if !have_tool("qemu-img") || !have_tool("nbdinfo") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let psk = psk_dir(dir.path());
        let keys = psk.join("keys.psk");
        let socket = dir.path().join("nbd.sock");
        let tls = ["--tls-psk-file", keys.to_str().unwrap(), "--tls-required"];
        let server = server_with_socket(dir.path(), &socket, &tls);
        server.create_tenant("alice");
        server.create_volume_with("v", "16MiB", &["--tenant", "alice"]);
        let info = qemu_img_info(&socket, &psk, "v");
        assert!(
            info.status.success(),
            "qemu-img over TLS on the socket: {}",
            text(&info)
        );
        assert!(String::from_utf8_lossy(&info.stdout).contains("16 MiB"));
        let uri = format!(
            "nbds+unix://alice@/v?socket={}&tls-psk-file={}",
            socket.display(),
            keys.display()
        );
        run_ok(Command::new("timeout").args(["60", "nbdinfo", &uri]));
        assert!(server.log().contains("TLS handshake done"));
        let plain = Command::new("nbdinfo")
            .arg(unix_uri(&socket, "v"))
            .output()
            .unwrap();
        assert!(
            !plain.status.success(),
            "plaintext got in: {}",
            text(&plain)
        );
        server.stop();

        // Our uid mapped to bob, the PSK says alice: refused.
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let mapping = format!("{}=bob", our_uid());
        let mut flags = tls.to_vec();
        flags.extend(["--nbd-unix-tenant", &mapping]);
        let server = server_with_socket(dir.path(), &socket, &flags);
        server.create_tenant("alice");
        server.create_volume_with("v", "16MiB", &["--tenant", "alice"]);
        let info = qemu_img_info(&socket, &psk, "v");
        assert!(
            !info.status.success(),
            "a conflicting uid got in: {}",
            text(&info)
        );
        assert!(
            server.log().contains("the TLS identity acts for tenant"),
            "{}",
            server.log()
        );
        server.stop();
    }
}
