//! A full filesystem under the data directory degrades the pool, it does not break it. The
//! test makes a small ext4 filesystem on a loop device, puts the server's data directory on
//! it with device files larger than the filesystem, and fills it from volume A until the
//! writes get ENOSPC. Then: writes into B's allocated extents and B's FLUSH keep working,
//! writes that need a new extent get ENOSPC (the NBD errno, and qemu-io says so), no device
//! is failed and no device error is counted, `/readyz` says whether a commit works; a restart
//! on the still-full filesystem serves every byte that was flushed; TRIM and delete of A
//! free space and new allocations succeed again, without a restart.
//!
//! Needs root and loop devices (skips with the reason otherwise, fails under
//! HEADROOM_REQUIRE_TOOLS=1). The mount and the loop device are undone by a Drop guard, also
//! when the test fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::openmetrics::{Sample, parse};
use common::raw::Client;
use common::{Server, TEST_TOKEN, agent, have_tool, run_ok, text};
use headroom_nbd::consts::{NBD_CMD_TRIM, NBD_ENOSPC};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// The filesystem the data directory lives on (64 MiB of it is the metadata reserve).
const FS_BYTES: u64 = 160 * MIB;

/// Root and loop devices, or the reason the test cannot run (a failure under
/// HEADROOM_REQUIRE_TOOLS).
fn can_loop_mount() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false);
    for (ok, why) in [
        (root, "not running as root"),
        (Path::new("/dev/loop-control").exists(), "no loop devices"),
    ] {
        if !ok {
            if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
                panic!(
                    "cannot loop-mount a filesystem here: {why} (HEADROOM_REQUIRE_TOOLS is set)"
                );
            }
            eprintln!("SKIPPED: cannot loop-mount a filesystem here: {why}");
            return false;
        }
    }
    true
}

/// A loop-mounted ext4 filesystem, unmounted and detached on drop.
struct LoopMount {
    dir: PathBuf,
    device: String,
}

impl LoopMount {
    fn new(image: &Path, dir: &Path, size_bytes: u64) -> LoopMount {
        std::fs::File::create(image)
            .unwrap()
            .set_len(size_bytes)
            .unwrap();
        run_ok(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-m", "0"])
                .arg(image),
        );
        let out = run_ok(
            Command::new("losetup")
                .args(["--find", "--show"])
                .arg(image),
        );
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        std::fs::create_dir_all(dir).unwrap();
        let guard = LoopMount {
            dir: dir.to_path_buf(),
            device,
        };
        run_ok(
            Command::new("mount")
                .args(["-t", "ext4"])
                .arg(&guard.device)
                .arg(dir),
        );
        guard
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

/// Bytes the filesystem at `dir` has free for root, and its size (`df -B1`).
fn df(dir: &Path) -> (u64, u64) {
    let out = run_ok(
        Command::new("df")
            .args(["-B1", "--output=size,avail"])
            .arg(dir),
    );
    let t = String::from_utf8_lossy(&out.stdout).to_string();
    let mut nums = t
        .lines()
        .nth(1)
        .expect("df line")
        .split_whitespace()
        .map(|n| n.parse::<u64>().unwrap());
    (nums.next().unwrap(), nums.next().unwrap())
}

/// MiB `i` of volume `v`, version `ver`: every 4 KiB block starts with the volume, the MiB
/// and the block's index, then `ver` throughout.
fn chunk(v: u8, i: u64, ver: u8) -> Vec<u8> {
    let mut b = vec![ver; MIB as usize];
    for (k, block) in b.chunks_mut(4096).enumerate() {
        block[0] = v;
        block[1..9].copy_from_slice(&(i * 256 + k as u64).to_le_bytes());
    }
    b
}

fn get(server: &Server, path: &str) -> (u16, String) {
    let r = agent()
        .get(format!("{}{path}", server.api))
        .header("authorization", format!("Bearer {TEST_TOKEN}"))
        .call();
    match r {
        Ok(mut resp) => (
            resp.status().as_u16(),
            resp.body_mut().read_to_string().unwrap_or_default(),
        ),
        Err(ureq::Error::StatusCode(code)) => (code, String::new()),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

/// No device is failed, and no device error (what `fail_device_after_errors` counts) was
/// counted for any operation: ENOSPC is counted apart.
fn assert_no_device_failed_nor_erred(server: &Server) {
    let (status, body) = get(server, "/v1/devices");
    assert_eq!(status, 200);
    let devices: Value = serde_json::from_str(&body).unwrap();
    for d in devices.as_array().unwrap() {
        assert_ne!(d["failed"], Value::Bool(true), "device failed: {d}");
    }
    let (status, body) = get(server, "/metrics");
    assert_eq!(status, 200);
    let samples: Vec<Sample> = parse(&body);
    let errors: f64 = samples
        .iter()
        .filter(|s| s.name == "headroom_device_errors_total")
        .map(|s| s.value)
        .sum();
    assert_eq!(errors, 0.0, "ENOSPC was counted as a device error");
}

/// `GET /readyz` (no token needed): its status and body.
fn readyz(server: &Server) -> (u16, String) {
    let r = agent().get(format!("{}/readyz", server.api)).call();
    match r {
        Ok(mut resp) => (
            resp.status().as_u16(),
            resp.body_mut().read_to_string().unwrap_or_default(),
        ),
        Err(ureq::Error::StatusCode(code)) => (code, String::new()),
        Err(e) => panic!("GET /readyz: {e}"),
    }
}

/// Trims `[offset, offset + len)` of the export in pieces of at most 1 GiB; the errno.
fn trim(c: &mut Client, offset: u64, len: u64) -> u32 {
    c.send_request(0, NBD_CMD_TRIM, 77, offset, len as u32);
    c.read_simple_reply().error
}

#[test]
fn a_full_filesystem_degrades_the_pool_and_recovers_when_space_is_freed() {
    if !can_loop_mount()
        || !have_tool("mkfs.ext4")
        || !have_tool("losetup")
        || !have_tool("qemu-io")
        || !have_tool("nbdcopy")
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mount = LoopMount::new(
        &tmp.path().join("fs.img"),
        &tmp.path().join("mnt"),
        FS_BYTES,
    );
    // The data directory is the filesystem's root; the server's log (`<dir>.log`) is beside
    // it, outside.
    let data = mount.dir.clone();
    // Two device files of 1 GiB each on a 96 MiB filesystem.
    let args = ["--devices", "2", "--device-size", "1GiB"];
    let server = Server::start_with(&data, &args);
    let (fs_size, free_at_start) = df(&mount.dir);
    println!("filesystem: {fs_size} bytes, {free_at_start} free after the server started");
    server.create_volume("a", "256MiB");
    server.create_volume("b", "16MiB");
    server.create_volume("c", "16MiB");

    // B: two extents allocated before the disk fills, 4 KiB of each written (the rest of
    // each was never written: on a sparse file it would need new blocks).
    let mut b = Client::open(server.nbd, "b");
    assert_eq!(b.write(1, 0, &[2u8; 4096], 0), 0);
    assert_eq!(b.write(2, 2 * MIB, &[2u8; 4096], 0), 0);
    assert_eq!(b.flush(9), 0);

    // Fill from A until ENOSPC, flushing every 8 MiB.
    let mut a = Client::open(server.nbd, "a");
    let mut written = 0u64;
    let mut flushed = 0u64;
    loop {
        let i = written / MIB;
        let e = a.write(100 + i, written, &chunk(1, i, 1), 0);
        if e == NBD_ENOSPC {
            break;
        }
        assert_eq!(e, 0, "write of MiB {i} of a: errno {e}");
        written += MIB;
        if written.is_multiple_of(8 * MIB) {
            assert_eq!(a.flush(1), 0, "flush of a at {written}");
            flushed = written;
        }
        assert!(written < 256 * MIB, "the filesystem never filled");
    }
    let (_, free_when_full) = df(&mount.dir);
    println!(
        "volume a: {written} bytes written before ENOSPC ({flushed} flushed); the filesystem \
         has {free_when_full} bytes free"
    );
    assert!(written >= 32 * MIB, "filled after only {written} bytes");
    // B's allocated extents take writes everywhere, also where nothing was written before,
    // and B flushes.
    for i in 0..4 {
        assert_eq!(
            b.write(10 + i, i * MIB, &chunk(2, i, 2), 0),
            0,
            "b's MiB {i}"
        );
    }
    assert_eq!(b.flush(11), 0, "b's FLUSH on the full disk");

    // ENOSPC comes when a new extent is allocated, not inside one: its blocks are reserved.
    assert_eq!(written % (2 * MIB), 0, "ENOSPC inside an allocated extent");
    // A new extent cannot be had: ENOSPC, again and again, and the device is not failed.
    for k in 0..20u64 {
        let off = written.next_multiple_of(2 * MIB) + k * 2 * MIB;
        assert_eq!(a.write(4, off, &[5u8; 4096], 0), NBD_ENOSPC);
    }
    assert_eq!(a.flush(5), 0, "a's FLUSH on the full disk");
    flushed = written;

    // C needs new extents: ENOSPC on NBD, and qemu-io says so.
    let mut c = Client::open(server.nbd, "c");
    assert_eq!(c.write(20, 0, &[6u8; 4096], 0), NBD_ENOSPC);
    let out = Command::new("qemu-io")
        .args(["-f", "raw", &server.uri("c"), "-c", "write -P 0x33 0 64k"])
        .output()
        .unwrap();
    let said = text(&out);
    assert!(
        said.contains("No space left on device"),
        "qemu-io on the full disk said: {said}"
    );
    assert_eq!(c.flush(21), 0);
    assert_no_device_failed_nor_erred(&server);
    // Metadata commits go on (the metadata reserve), and `/readyz` says whether the disk
    // is full: 503 naming the reserve once a commit had to use it, 200 while it is held.
    let out = server.cli(&["volume", "create", "probe", "--size", "4MiB"]);
    assert!(
        out.status.success(),
        "a commit on the full disk: {}",
        text(&out)
    );
    let (status, body) = readyz(&server);
    println!("readyz on the full disk: {status} {body}");
    assert!(
        status == 200 || (status == 503 && body.contains("metadata reserve in use")),
        "/readyz on the full disk: {status} {body}"
    );
    drop((a, b, c));

    // Restart on the still-full filesystem: everything flushed reads back.
    let status = server.stop_any();
    println!("stopped on the full disk: {status}");
    let server = Server::start_with(&data, &args);
    let out_a = tmp.path().join("a.raw");
    run_ok(Command::new("nbdcopy").arg(server.uri("a")).arg(&out_a));
    let back = std::fs::read(&out_a).unwrap();
    for i in 0..flushed / MIB {
        let at = (i * MIB) as usize;
        assert!(
            back[at..at + MIB as usize] == chunk(1, i, 1)[..],
            "a's MiB {i} after the restart"
        );
    }
    let mut b = Client::open(server.nbd, "b");
    for i in 0..4 {
        assert_eq!(b.read(30 + i, i * MIB, MIB as u32).unwrap(), chunk(2, i, 2));
    }
    assert_no_device_failed_nor_erred(&server);

    // Free space: TRIM all of A. New allocations succeed at once, no restart.
    let mut a = Client::open(server.nbd, "a");
    assert_eq!(trim(&mut a, 0, 256 * MIB), 0);
    assert_eq!(a.flush(40), 0);
    let (_, free_after_trim) = df(&mount.dir);
    println!("after TRIM of a: {free_after_trim} bytes free");
    assert!(free_after_trim > 32 * MIB, "{free_after_trim}");
    let mut c = Client::open(server.nbd, "c");
    for i in 0..8 {
        assert_eq!(
            c.write(50 + i, i * MIB, &chunk(3, i, 1), 0),
            0,
            "c's MiB {i}"
        );
    }
    assert_eq!(c.flush(59), 0);
    drop((a, c));
    let out = server.cli(&["volume", "delete", "a"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = Command::new("qemu-io")
        .args(["-f", "raw", &server.uri("c"), "-c", "write -P 0x33 8M 64k"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-io after space was freed: {}",
        text(&out)
    );
    let (status, body) = readyz(&server);
    assert_eq!(status, 200, "/readyz once space was freed: {body}");
    assert_no_device_failed_nor_erred(&server);

    // `headroom device restore`: a device in service is left alone, an unknown one is 404;
    // a failed device holding c's data fails c's FLUSH until it is restored.
    let out = server.cli(&["device", "restore", "0"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("in service already"), "{}", text(&out));
    let out = server.cli(&["device", "restore", "99"]);
    assert!(
        !out.status.success() && text(&out).contains("404"),
        "{}",
        text(&out)
    );
    let out = server.cli(&["device", "fail", "0"]);
    assert!(out.status.success(), "{}", text(&out));
    let mut c = Client::open(server.nbd, "c");
    assert_eq!(
        c.flush(60),
        headroom_nbd::consts::NBD_EIO,
        "c has data on the failed device"
    );
    let out = server.cli(&["device", "restore", "0", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["restored"], Value::Bool(true), "{r}");
    assert_eq!(c.flush(61), 0, "c's FLUSH after the restore");
    assert_eq!(c.read(62, 0, MIB as u32).unwrap(), chunk(3, 0, 1));
    assert_no_device_failed_nor_erred(&server);
    assert!(!server.log().contains("panicked"));
    drop(c);
    server.stop();
}
