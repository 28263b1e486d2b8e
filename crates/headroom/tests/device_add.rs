//! `headroom device add` / `POST /v1/devices` take a device only on purpose: a real server
//! over loopback is handed the mistaken paths an operator (or a script) might give, and each
//! target is hashed before and after the refused request — nothing outside the allowed
//! places, nothing that is not a regular file or a configured block device, nothing holding
//! a filesystem or data (without `--force`) is written, opened or created. Block devices run
//! on loop devices (losetup; needs root): one named in the configuration is taken (and
//! signed), the same one held open exclusively elsewhere is refused, one not named is refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Server, have_tool};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;

/// A digest of a regular file's (or a symlink's target's) bytes and its length; of a
/// device, FIFO or directory only its type and node (reading /dev/zero never ends). `None`:
/// it does not exist.
fn digest(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(path).ok()?;
    if !md.is_file() && !md.file_type().is_block_device() {
        return Some((md.mode().into(), md.rdev()));
    }
    let bytes = std::fs::read(path).ok()?;
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    Some((h.finish(), bytes.len() as u64))
}

/// `POST /v1/devices` with `body`: (status, JSON answer).
fn add(server: &Server, body: Value) -> (u16, Value) {
    let mut response = common::agent()
        .post(format!("{}/v1/devices", server.api))
        .header("authorization", common::bearer())
        .send_json(body)
        .unwrap();
    let status = response.status().as_u16();
    let value: Value = response.body_mut().read_json().unwrap_or(Value::Null);
    (status, value)
}

/// The reason of a refused request with the requested path taken out, so that two texts for
/// two paths compare.
fn reason(answer: &Value, path: &Path) -> String {
    answer["error"]
        .as_str()
        .unwrap_or_default()
        .replace(&path.display().to_string(), "PATH")
}

/// Asks for `path` (with `force`), expects a 400 and `path` unchanged; returns the reason.
fn refused(server: &Server, path: &Path, force: bool) -> String {
    let before = digest(path);
    let (status, answer) = add(
        server,
        json!({ "path": path.to_str().unwrap(), "size_bytes": 8 * MIB, "force": force }),
    );
    assert_eq!(status, 400, "{} was not refused: {answer}", path.display());
    assert_eq!(answer["kind"], "invalid_device", "{answer}");
    assert_eq!(digest(path), before, "{} changed", path.display());
    reason(&answer, path)
}

fn write_config(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("node.toml");
    std::fs::write(&path, body).unwrap();
    path
}

fn device_count(server: &Server) -> usize {
    let mut response = common::agent()
        .get(format!("{}/v1/devices", server.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    let devices: Value = response.body_mut().read_json().unwrap();
    devices.as_array().unwrap().len()
}

#[test]
fn mistaken_paths_are_refused_and_left_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = write_config(dir.path(), "[storage]\nmax_volume_bytes = \"1GiB\"\n");
    let server = Server::start_with(
        &data,
        &[
            "--devices",
            "1",
            "--device-size",
            "8MiB",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    let devices = data.join("devices");

    // Outside the device directory: a file of data and a missing path get one text.
    let outside = dir.path().join("precious.img");
    common::random_file(&outside, 8 << 20, 1);
    let text = refused(&server, &outside, false);
    assert!(text.contains("not a file in a device directory"), "{text}");
    assert_eq!(
        refused(&server, &outside, true),
        text,
        "force opens nothing"
    );
    let missing = dir.path().join("missing.img");
    assert_eq!(refused(&server, &missing, false), text);
    assert!(!missing.exists());
    let nodir = dir.path().join("nodir/x.img");
    assert_eq!(refused(&server, &nodir, false), text);
    assert!(!dir.path().join("nodir").exists());
    // `..` out of devices/ is outside too, and so is /dev/null (a character device).
    assert_eq!(
        refused(&server, &devices.join("../../precious.img"), true),
        text
    );
    for dev in ["/dev/null", "/dev/zero"] {
        assert_eq!(refused(&server, Path::new(dev), true), text, "{dev}");
    }

    // The pool's own files, even with force.
    let meta = data.join("meta.redb");
    let meta_before = digest(&meta);
    assert_eq!(refused(&server, &meta, true), text);
    assert_eq!(digest(&meta), meta_before);

    // A symlink inside devices/ to the file outside: refused, neither touched.
    let link = devices.join("link.img");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let t = refused(&server, &link, true);
    assert!(
        t.contains("symbolic link") && t.contains("not opened"),
        "{t}"
    );
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(digest(&outside).map(|d| d.1), Some(8 << 20));

    // A missing directory inside devices/: refused, not created.
    let nested = devices.join("sub/x.img");
    let t = refused(&server, &nested, false);
    assert!(t.contains("does not exist"), "{t}");
    assert!(!devices.join("sub").exists());

    // A character device and a FIFO inside devices/: refused without being opened.
    let null = devices.join("null");
    assert!(
        Command::new("mknod")
            .args([null.to_str().unwrap(), "c", "1", "3"])
            .status()
            .unwrap()
            .success()
    );
    assert!(refused(&server, &null, true).contains("character device"));
    let fifo = devices.join("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    assert!(refused(&server, &fifo, true).contains("FIFO"));

    // A file of data inside devices/: refused without --force (unchanged), taken with it.
    let data_file = devices.join("random.img");
    common::random_file(&data_file, 8 << 20, 2);
    let t = refused(&server, &data_file, false);
    assert!(t.contains("holds data") && t.contains("--force"), "{t}");
    let out = server.cli(&[
        "device",
        "add",
        data_file.to_str().unwrap(),
        "--force",
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::text(&out));
    let added: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(added["reserved_extents"], 1, "{added}");
    assert_eq!(
        &std::fs::read(&data_file).unwrap()[..16],
        b"HEADROOM-DEVICE\0"
    );
    // Now it carries this pool's signature: another name for it is refused even with force.
    let hard = devices.join("hardlink.img");
    std::fs::hard_link(&data_file, &hard).unwrap();
    let t = refused(&server, &hard, true);
    assert!(t.contains("this pool"), "{t}");

    // A filesystem (mkfs.ext4 on a file): refused without --force.
    if have_tool("mkfs.ext4") {
        let ext4 = devices.join("ext4.img");
        std::fs::File::create(&ext4)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        assert!(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", ext4.to_str().unwrap()])
                .status()
                .unwrap()
                .success()
        );
        let t = refused(&server, &ext4, false);
        assert!(t.contains("ext2/ext3/ext4"), "{t}");
    }

    // The caps: an 8 PiB request is refused before anything is created; a volume above
    // max_volume_bytes is refused.
    let next = devices.join(format!("dev-{}.img", device_count(&server)));
    let (status, answer) = add(&server, json!({ "size_bytes": 8u64 << 50 }));
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("max_device_bytes"),
        "{answer}"
    );
    assert!(!next.exists());
    let out = server.cli(&["volume", "create", "big", "--size", "2GiB"]);
    assert!(!out.status.success());
    assert!(
        common::text(&out).contains("max_volume_bytes"),
        "{}",
        common::text(&out)
    );
    assert!(
        server
            .cli(&["volume", "create", "ok", "--size", "1GiB"])
            .status
            .success()
    );

    // An all-zero sparse file inside devices/ and a new one are fine.
    let sparse = devices.join("sparse.img");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let (status, answer) = add(&server, json!({ "path": sparse.to_str().unwrap() }));
    assert_eq!(status, 201, "{answer}");
    let (status, answer) = add(&server, json!({ "size_bytes": 8 * MIB }));
    assert_eq!(status, 201, "{answer}");
    assert_eq!(device_count(&server), 4);
    server.stop();
}

/// A loop device over a new file of `size` bytes; detached on drop.
struct Loop {
    device: PathBuf,
    backing: PathBuf,
}

impl Loop {
    fn new(backing: &Path, size: u64) -> Option<Loop> {
        std::fs::File::create(backing)
            .unwrap()
            .set_len(size)
            .unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show", backing.to_str().unwrap()])
            .output()
            .ok()?;
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).to_string();
            if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
                panic!("losetup failed (HEADROOM_REQUIRE_TOOLS is set): {why}");
            }
            eprintln!("SKIPPED: losetup cannot attach a loop device here: {why}");
            return None;
        }
        let device = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Some(Loop {
            device,
            backing: backing.to_path_buf(),
        })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

#[test]
fn only_configured_block_devices_are_taken_and_a_claimed_one_is_refused() {
    if !have_tool("losetup") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(named) = Loop::new(&dir.path().join("named.img"), 32 * MIB) else {
        return;
    };
    let Some(other) = Loop::new(&dir.path().join("other.img"), 32 * MIB) else {
        return;
    };
    let config = write_config(
        dir.path(),
        &format!(
            "[storage]\nblock_devices = [\"{}\"]\n",
            named.device.display()
        ),
    );
    let data = dir.path().join("data");
    let server = Server::start_with(
        &data,
        &[
            "--devices",
            "1",
            "--device-size",
            "8MiB",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    // Not named in the configuration: refused with the text of any path outside.
    let t = refused(&server, &other.device, true);
    assert!(t.contains("not a file in a device directory"), "{t}");

    // Named, but held open exclusively by another program (as a mount would): EBUSY.
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(0o200) // O_EXCL: an exclusive claim on a block device
        .open(&named.device)
        .unwrap();
    let t = refused(&server, &named.device, false);
    assert!(t.contains("in use") && t.contains("EBUSY"), "{t}");
    drop(holder);

    // Data on it (in its first 4 MiB, which the bounded scan of a block device reads whole):
    // refused without force.
    common::random_file(&dir.path().join("junk"), 4096, 3);
    let junk = std::fs::read(dir.path().join("junk")).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&named.device)
        .and_then(|f| std::os::unix::fs::FileExt::write_all_at(&f, &junk, MIB))
        .unwrap();
    let t = refused(&server, &named.device, false);
    assert!(t.contains("holds data"), "{t}");

    // With force: taken, signed, and refused as a device of the pool afterwards.
    let (status, answer) = add(
        &server,
        json!({ "path": named.device.to_str().unwrap(), "force": true }),
    );
    assert_eq!(status, 201, "{answer}");
    assert_eq!(answer["extent_count"], 15, "{answer}");
    assert_eq!(
        &std::fs::read(&named.backing).unwrap()[..16],
        b"HEADROOM-DEVICE\0"
    );
    let (status, _) = add(&server, json!({ "path": named.device.to_str().unwrap() }));
    assert_eq!(status, 409);
    server.stop();
}

#[test]
fn the_openapi_document_lists_the_force_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("m"), "64MiB");
    let mut response = common::agent()
        .get(format!("{}/openapi.json", server.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    let doc: Value = response.body_mut().read_json().unwrap();
    let force = &doc["components"]["schemas"]["AddDevice"]["properties"]["force"];
    assert_eq!(force["type"], "boolean", "{force}");
    server.stop();
}
