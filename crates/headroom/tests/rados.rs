//! The RADOS backend end to end (built only with `--features rados`): a real Ceph cluster,
//! the real `headroom serve --rados-conf --rados-pool`, and fio over NBD.
//!
//! * fio writes a volume with crc32c verify headers and reads every block back: zero errors;
//! * the blocks are RADOS objects of the store's namespace, and the data directory holds no
//!   device file;
//! * after the server is killed with SIGKILL (following fio's final FLUSH) and started again
//!   on the same data directory and pool, fio verifies every block again: the data lives in
//!   the cluster, not in the server process;
//! * that restart after a crash removes the object of a free extent (as a crash can leave
//!   behind) and leaves other namespaces of the pool alone;
//! * deleting the volumes removes every object of the store.
//!
//! The cluster: the one named by `HEADROOM_TEST_CEPH_CONF` (pool `HEADROOM_TEST_CEPH_POOL`,
//! default `headroom`), as `.ci/run` sets; otherwise this test starts its own with
//! `scripts/ceph-test-cluster` on free ports and stops it at the end. Without Ceph installed
//! it is skipped with the reason, unless `HEADROOM_REQUIRE_TOOLS` is set (CI), where that
//! fails.
#![cfg(feature = "rados")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Server, have_tool, run_ok, text};
use serde_json::Value;

const VOLUME: &str = "vol";
/// What fio writes: 4096 blocks of 12 KiB. 12 KiB does not divide 2 MiB, so some blocks
/// straddle two extents, that is two RADOS objects.
const BLOCK: u64 = 12 << 10;
const DATA_BYTES: u64 = 4096 * BLOCK;

/// A cluster this test started; stopped (by its recorded PIDs) when dropped, also on panic.
struct OwnCluster {
    dir: PathBuf,
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let out = Command::new(script())
            .arg("down")
            .arg(&self.dir)
            .output()
            .expect("run ceph-test-cluster down");
        eprintln!("{}", text(&out));
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-test-cluster")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// Says why the test cannot run: a failure in CI (`HEADROOM_REQUIRE_TOOLS`), a skip elsewhere.
fn cannot_run(why: &str) {
    if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
        panic!("the RADOS test must run here (HEADROOM_REQUIRE_TOOLS is set): {why}");
    }
    eprintln!("SKIPPED: {why}");
}

/// A cluster the test uses: its ceph.conf, the pool, the cephx user the nodes connect as
/// (`--rados-id`), and the cluster itself if this test started it.
struct Ceph {
    conf: PathBuf,
    pool: String,
    id: String,
    own: Option<OwnCluster>,
}

/// The cluster of `HEADROOM_TEST_CEPH_CONF` (user `HEADROOM_TEST_CEPH_ID`, default admin), or
/// one of this test's own (user `headroom`, which scripts/ceph-test-cluster creates with the
/// documented caps); `None` when there is none.
fn cluster(scratch: &Path) -> Option<Ceph> {
    if let Some(conf) = std::env::var_os("HEADROOM_TEST_CEPH_CONF") {
        let pool = std::env::var("HEADROOM_TEST_CEPH_POOL").unwrap_or_else(|_| "headroom".into());
        let id = std::env::var("HEADROOM_TEST_CEPH_ID").unwrap_or_else(|_| "admin".into());
        return Some(Ceph {
            conf: PathBuf::from(conf),
            pool,
            id,
            own: None,
        });
    }
    own_cluster(scratch)
}

/// A cluster started for this test alone, on free ports (stopped when the result drops).
fn own_cluster(scratch: &Path) -> Option<Ceph> {
    if !Path::new("/usr/bin/ceph-mon").exists() {
        cannot_run(
            "no Ceph cluster: set HEADROOM_TEST_CEPH_CONF, or install ceph-mon ceph-osd \
             ceph-common (scripts/ceph-test-cluster up DIR installs them)",
        );
        return None;
    }
    let dir = scratch.join("ceph");
    let out = Command::new(script())
        .arg("up")
        .arg(&dir)
        // No mgr: this test needs I/O, not health reports; the script then waits until a
        // probe object was written and read back.
        .env("CEPH_TEST_MGR", "0")
        .env("CEPH_TEST_INSTALL", "0")
        .env("CEPH_TEST_POOL", "headroom")
        .env("CEPH_TEST_MON_PORT", free_port().to_string())
        .env("CEPH_TEST_MON_PORT_V1", free_port().to_string())
        .output()
        .expect("run ceph-test-cluster up");
    let own = OwnCluster { dir: dir.clone() };
    if !out.status.success() {
        cannot_run(&format!(
            "scripts/ceph-test-cluster could not start a cluster: {}",
            text(&out)
        ));
        return None;
    }
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    Some(Ceph {
        conf: dir.join("ceph.conf"),
        pool: "headroom".into(),
        id: "headroom".into(),
        own: Some(own),
    })
}

/// fio over NBD on the volume: 12 KiB random writes with crc32c verify headers, then a FLUSH
/// (`end_fsync`), then a read of every block checking it (`do_verify`); with `verify_only`,
/// only the reads and checks of the same blocks (same seed). Returns fio's JSON report.
fn fio(server: &Server, volume: &str, verify_only: bool) -> Value {
    let out = run_ok(&mut fio_command(server, volume, verify_only));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON document.
    let json = &stdout[stdout.find('{').expect("fio printed JSON")..];
    serde_json::from_str(json).unwrap_or_else(|e| panic!("fio JSON ({e}): {stdout}"))
}

fn fio_command(server: &Server, volume: &str, verify_only: bool) -> Command {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=rados",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri(volume)),
        "--rw=randwrite",
        &format!("--bs={BLOCK}"),
        &format!("--size={DATA_BYTES}"),
        "--iodepth=16",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--end_fsync=1",
        "--output-format=json",
    ]);
    if verify_only {
        cmd.arg("--verify_only");
    }
    cmd
}

fn job(report: &Value) -> &Value {
    let jobs = report["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 1, "{report}");
    &jobs[0]
}

#[test]
fn fio_verify_on_rados_and_the_data_outlives_the_server() {
    if !have_tool("fio") {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        id,
        own: _own,
    }) = cluster(scratch.path())
    else {
        return;
    };
    let conf_arg = conf.to_str().unwrap().to_string();
    let rados_flags = [
        "--rados-conf",
        conf_arg.as_str(),
        "--rados-id",
        id.as_str(),
        "--rados-pool",
        pool.as_str(),
        "--device-size",
        "1GiB",
        // The restart after the SIGKILL below waits for the killed node's lease to expire.
        "--rados-lease-ms",
        "3000",
    ];
    let data_dir = scratch.path().join("data");
    let server = Server::start_with(&data_dir, &rados_flags);
    server.create_volume(VOLUME, "64MiB");
    // Ceph keeps the copies: a replicated volume is refused, saying so (422).
    let out = server.cli(&[
        "volume",
        "create",
        "r2",
        "--size",
        "4MiB",
        "--replicas",
        "2",
    ]);
    assert!(!out.status.success(), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Ceph") && err.contains("422"), "{err}");

    let started = std::time::Instant::now();
    let written = fio(&server, VOLUME, false);
    let j = job(&written);
    assert_eq!(j["error"].as_i64(), Some(0), "{j}");
    assert_eq!(j["write"]["io_bytes"].as_u64(), Some(DATA_BYTES), "{j}");
    // The verify phase read back every block it wrote.
    assert_eq!(j["read"]["io_bytes"].as_u64(), Some(DATA_BYTES), "{j}");
    eprintln!(
        "fio write+verify of {} MiB: {:.1} s",
        DATA_BYTES >> 20,
        started.elapsed().as_secs_f64()
    );

    // Where the data is: objects ext.0.<hex> in the store's namespace of the pool.
    let out = server.cli(&["pool", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let path = info["devices"][0]["path"].as_str().expect("device path");
    let namespace = path
        .strip_prefix(&format!("rados:{pool}/"))
        .unwrap_or_else(|| panic!("device path {path} is not in pool {pool}"));
    assert!(namespace.starts_with("headroom-"), "{path}");
    assert_eq!(info["devices"].as_array().unwrap().len(), 1, "{info}");
    let out = run_ok(
        Command::new("rados")
            .args(["-c", &conf_arg, "-p", &pool, "-N", namespace, "ls"])
            .env_remove("CEPH_ARGS"),
    );
    let all: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    // The metadata and the lease are objects of the namespace too; the data directory keeps
    // only local state.
    for name in ["meta", "lease"] {
        assert!(all.iter().any(|o| o == name), "no object {name}: {all:?}");
    }
    assert!(
        !data_dir.join("meta.redb").exists(),
        "a RADOS store kept its metadata locally"
    );
    assert_eq!(
        std::fs::read_to_string(data_dir.join("rados-namespace"))
            .unwrap()
            .trim(),
        namespace
    );
    let objects: Vec<String> = all.into_iter().filter(|o| o.starts_with("ext.")).collect();
    // fio wrote the first 48 MiB of the volume: 24 extents of 2 MiB, one object each.
    assert_eq!(objects.len(), 24, "{objects:?}");
    assert!(
        objects
            .iter()
            .all(|o| o.starts_with("ext.0.") && o.len() == 14),
        "{objects:?}"
    );
    assert!(
        !data_dir.join("devices").exists(),
        "a RADOS store made local device files"
    );

    // fio ended with a FLUSH; nothing more is flushed: the process dies at once.
    server.kill9();
    // What a crash can leave: data in the object of an extent whose allocation never became
    // durable (extent 500 of 512 is free). Beside it, an object of the same name in another
    // namespace, which is not this store's.
    let junk = scratch.path().join("junk");
    std::fs::write(&junk, vec![0x5a_u8; 8192]).unwrap();
    let stray = "ext.0.000001f4";
    let other_namespace = format!("{namespace}-other");
    for ns in [namespace, other_namespace.as_str()] {
        run_ok(Command::new("rados").args([
            "-c",
            &conf_arg,
            "-p",
            &pool,
            "-N",
            ns,
            "put",
            stray,
            junk.to_str().unwrap(),
        ]));
    }
    let list = |ns: &str| -> Vec<String> {
        let out =
            run_ok(Command::new("rados").args(["-c", &conf_arg, "-p", &pool, "-N", ns, "ls"]));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|o| o.starts_with("ext."))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(list(namespace).len(), 25);
    let server = Server::start_with(&data_dir, &rados_flags);
    // The start after the crash punched the free extents: the stray object is gone, the 24
    // extents in use are not, and the other namespace was not touched.
    let mut after = list(namespace);
    after.sort();
    let mut before = objects.clone();
    before.sort();
    assert_eq!(after, before);
    assert_eq!(list(&other_namespace), vec![stray.to_string()]);
    run_ok(Command::new("rados").args([
        "-c",
        &conf_arg,
        "-p",
        &pool,
        "-N",
        &other_namespace,
        "rm",
        stray,
    ]));
    let started = std::time::Instant::now();
    let verified = fio(&server, VOLUME, true);
    let j = job(&verified);
    assert_eq!(j["error"].as_i64(), Some(0), "{j}");
    // (fio reports the skipped writes of a verify-only run as done; only the reads count.)
    assert_eq!(j["read"]["io_bytes"].as_u64(), Some(DATA_BYTES), "{j}");
    eprintln!(
        "fio verify of {} MiB after a restart: {:.1} s",
        DATA_BYTES >> 20,
        started.elapsed().as_secs_f64()
    );

    // The same check on a volume that was never written fails: it does look at the data.
    server.create_volume("blank", "64MiB");
    let out = fio_command(&server, "blank", true)
        .output()
        .expect("run fio");
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("verify"),
        "fio verified blocks nobody wrote: {}",
        text(&out)
    );

    // Deleting the volumes releases their extents: every extent object of the store is
    // removed (only `meta` and `lease` stay).
    for volume in [VOLUME, "blank"] {
        let out = server.cli(&["volume", "delete", volume]);
        assert!(out.status.success(), "{}", text(&out));
    }
    assert_eq!(list(namespace), Vec::<String>::new());
    server.stop();
}

/// The lease of the failover test: short, so the test waits seconds, not the default 30.
const LEASE_MS: u64 = 3000;

/// Runs `headroom serve` on `data_dir` with `flags` and checks that it refuses to start,
/// saying `why`.
fn serve_refuses(data_dir: &Path, flags: &[String], why: &str) {
    let out = Command::new(common::BIN)
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .args(flags)
        .env("HEADROOM_TOKEN", "0123456789abcdef0123456789abcdef")
        .output()
        .expect("run headroom serve");
    assert!(
        !out.status.success() && text(&out).contains(why),
        "{}",
        text(&out)
    );
}

/// Polls `cond` every 50 ms until it holds, panicking with `what` after `limit`.
fn wait_until(limit: std::time::Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Sends SIGSTOP or SIGCONT to a server.
fn signal(server: &Server, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &server.pid().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} failed");
}

/// Reads simple replies until the server closes the connection (or 30 s pass): the
/// (cookie, error) of each reply that arrived.
fn replies_until_closed(client: &mut common::raw::Client) -> Vec<(u64, u32)> {
    use std::io::Read as _;
    client
        .stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut out = Vec::new();
    let mut header = [0u8; 16];
    while client.stream.read_exact(&mut header).is_ok() {
        out.push((
            u64::from_be_bytes(header[8..16].try_into().unwrap()),
            u32::from_be_bytes(header[4..8].try_into().unwrap()),
        ));
    }
    out
}

/// Several nodes, one store, with real processes on one cluster:
///
/// * failover: node A serves a volume and fio writes it (crc32c verify headers, final
///   FLUSH); node B, started on its own data directory with A's namespace, waits for A's
///   lease; A is killed with SIGKILL; B takes the lease once it expires, fences A, and serves
///   the volume: fio verifies every block on B, zero errors. The time from the kill to B
///   serving is printed (docs/results.md);
/// * fencing: B is paused (SIGSTOP) with a client connected; node C takes over; the client
///   sends B a write, B resumes (SIGCONT): the write is never acknowledged (an error reply or
///   a closed connection), B exits because it lost its lease, and C's data is unchanged;
/// * a clean stop releases the lease: node D starts at once and has nobody to fence; while
///   D holds it, a node that may wait only 500 ms gives up with a clear message; a
///   namespace that holds no store is refused, and so is A's data directory without the
///   pool.
#[test]
fn a_second_node_takes_over_a_dead_one_and_a_paused_one_is_fenced() {
    use common::raw::Client;
    use headroom_nbd::consts::{NBD_CMD_FLUSH, NBD_CMD_WRITE};
    use std::io::Write as _;
    use std::time::{Duration, Instant};

    if !have_tool("fio") {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        id,
        own: _own,
    }) = cluster(scratch.path())
    else {
        return;
    };
    let conf_arg = conf.to_str().unwrap().to_string();
    let lease = LEASE_MS.to_string();
    let base: Vec<String> = [
        "--rados-conf",
        &conf_arg,
        "--rados-id",
        &id,
        "--rados-pool",
        &pool,
        "--device-size",
        "1GiB",
        "--rados-lease-ms",
        &lease,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let as_strs = |v: &[String]| v.iter().map(String::as_str).collect::<Vec<_>>().join("\n");

    // Node A: a new store.
    let a_dir = scratch.path().join("a");
    let a = Server::start_with(&a_dir, &as_strs(&base).lines().collect::<Vec<_>>());
    a.create_volume(VOLUME, "64MiB");
    let written = fio(&a, VOLUME, false);
    let j = job(&written);
    assert_eq!(j["error"].as_i64(), Some(0), "{j}");
    assert_eq!(j["read"]["io_bytes"].as_u64(), Some(DATA_BYTES), "{j}");
    let namespace = std::fs::read_to_string(a_dir.join("rados-namespace"))
        .unwrap()
        .trim()
        .to_string();
    let mut takeover = base.clone();
    takeover.extend(["--rados-namespace".to_string(), namespace.clone()]);

    // Node B: same pool and namespace, its own data directory; it waits for A's lease.
    let b_dir = scratch.path().join("b");
    let b_log = b_dir.with_extension("log");
    let b_flags = as_strs(&takeover);
    let b_start = {
        let b_dir = b_dir.clone();
        std::thread::spawn(move || Server::start_with(&b_dir, &b_flags.lines().collect::<Vec<_>>()))
    };
    wait_until(
        Duration::from_secs(60),
        "node B waits for the lease",
        || {
            std::fs::read_to_string(&b_log)
                .unwrap_or_default()
                .contains("held by another node")
        },
    );
    assert!(
        !b_start.is_finished(),
        "node B serves while A holds the lease"
    );

    let killed = Instant::now();
    a.kill9();
    let b = b_start.join().expect("node B started");
    let failover = killed.elapsed();
    eprintln!(
        "failover: {:.2} s from SIGKILL of node A to node B serving (lease {} ms)",
        failover.as_secs_f64(),
        LEASE_MS
    );
    // A renews every third of the lease, so at the kill at least two thirds were left: B
    // waited for the expiry. And it did not wait much longer.
    assert!(
        failover >= Duration::from_millis(LEASE_MS / 2),
        "B served {failover:?} after the kill: before A's lease expired"
    );
    assert!(failover < Duration::from_millis(LEASE_MS) + Duration::from_secs(20));
    assert!(
        b.log().contains("fenced it (blocklisted)"),
        "B did not fence A: {}",
        b.log()
    );
    let verified = fio(&b, VOLUME, true);
    let j = job(&verified);
    assert_eq!(j["error"].as_i64(), Some(0), "{j}");
    assert_eq!(j["read"]["io_bytes"].as_u64(), Some(DATA_BYTES), "{j}");
    // B's own data directory holds only local state.
    assert!(!b_dir.join("meta.redb").exists() && !b_dir.join("devices").exists());

    // Fencing: a client of B writes and flushes, then B is paused and C takes over.
    let mut on_b = Client::open(b.nbd, VOLUME);
    assert_eq!(on_b.write(1, 0, &[0xb1; 4096], 0), 0);
    assert_eq!(on_b.flush(2), 0);
    signal(&b, "STOP");
    let c_dir = scratch.path().join("c");
    let c = Server::start_with(&c_dir, &as_strs(&takeover).lines().collect::<Vec<_>>());
    assert!(c.log().contains("fenced it (blocklisted)"), "{}", c.log());
    let mut on_c = Client::open(c.nbd, VOLUME);
    assert_eq!(on_c.read(3, 0, 4096).unwrap(), vec![0xb1; 4096]);
    assert_eq!(on_c.write(4, 0, &[0xc1; 4096], 0), 0);
    assert_eq!(on_c.flush(5), 0);
    // B's late write: sent while B is paused, handled when it resumes.
    on_b.send_request(0, NBD_CMD_WRITE, 6, 0, 4096);
    on_b.stream.write_all(&[0xb2; 4096]).unwrap();
    on_b.send_request(0, NBD_CMD_FLUSH, 7, 0, 0);
    signal(&b, "CONT");
    let replies = replies_until_closed(&mut on_b);
    eprintln!("node B's replies after it resumed (cookie, error): {replies:?}");
    assert!(
        !replies
            .iter()
            .any(|&(cookie, error)| cookie == 6 && error == 0),
        "the fenced node acknowledged a write: {replies:?}"
    );
    let mut b = b;
    wait_until(Duration::from_secs(30), "node B exits", || !b.is_running());
    assert!(b.log().contains("lost the store's lease"), "{}", b.log());
    assert_eq!(
        b.exit_status().and_then(|s| s.code()),
        Some(headroom_store::LEASE_LOST_EXIT_STATUS),
        "{}",
        b.log()
    );
    // C's data is what C wrote, on its connection and on a new one.
    assert_eq!(on_c.read(8, 0, 4096).unwrap(), vec![0xc1; 4096]);
    let mut fresh = Client::open(c.nbd, VOLUME);
    assert_eq!(fresh.read(9, 0, 4096).unwrap(), vec![0xc1; 4096]);
    drop((on_c, fresh));

    // A clean stop releases the lease: D takes it at once and fences nobody.
    c.stop();
    let d_dir = scratch.path().join("d");
    let mut d_flags = takeover.clone();
    d_flags.extend(["--rados-lease-wait-ms".to_string(), "1".to_string()]);
    let d = Server::start_with(&d_dir, &as_strs(&d_flags).lines().collect::<Vec<_>>());
    assert!(!d.log().contains("fenced"), "{}", d.log());
    let mut on_d = Client::open(d.nbd, VOLUME);
    assert_eq!(on_d.read(10, 0, 4096).unwrap(), vec![0xc1; 4096]);
    // While D holds it, a node that may wait 500 ms gives up, saying why.
    let mut e_flags = takeover.clone();
    e_flags.extend(["--rados-lease-wait-ms".to_string(), "500".to_string()]);
    serve_refuses(
        &scratch.path().join("e"),
        &e_flags,
        "is held by another node",
    );
    // The data directory of a RADOS store started without the pool is refused (it must not
    // become a new file store).
    serve_refuses(&a_dir, &[], "is the local state of a RADOS store");
    assert!(!a_dir.join("meta.redb").exists() && !a_dir.join("devices").exists());
    // A namespace that holds no store is refused, not made into a new empty one.
    let mut typo = base.clone();
    typo.extend(["--rados-namespace".to_string(), format!("{namespace}-typo")]);
    serve_refuses(
        &scratch.path().join("f"),
        &typo,
        "there is no Headroom store in namespace",
    );
    let out = d.cli(&["volume", "delete", VOLUME]);
    assert!(out.status.success(), "{}", text(&out));
    d.stop();
}

/// A paused OSD (SIGSTOP), resumed (SIGCONT) when dropped, also when the test fails.
struct PausedOsd(String);

impl PausedOsd {
    fn pause(cluster_dir: &Path) -> PausedOsd {
        let pid = std::fs::read_to_string(cluster_dir.join("pids/osd.0.pid")).unwrap();
        let pid = pid.trim().to_string();
        let status = Command::new("kill").args(["-STOP", &pid]).status().unwrap();
        assert!(status.success(), "kill -STOP {pid}");
        PausedOsd(pid)
    }
}

impl Drop for PausedOsd {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.0]).status();
    }
}

/// A hung cluster turns into I/O errors, not requests that never end: librados'
/// `rados_osd_op_timeout`, which Headroom sets to 30 s unless the ceph.conf says otherwise
/// (2 s here, in the `[client.headroom]` section of the file the node reads). The OSD is paused
/// with SIGSTOP, so this test always starts a cluster of its own, even when
/// `HEADROOM_TEST_CEPH_CONF` names a shared one:
///
/// * a write and a read of a written block (the asynchronous path), sent while the OSD is
///   paused, are answered EIO after the timeout (not before 1.5 s, well within 15 s);
/// * once the OSD resumes, the same connection writes and reads the block again: the node
///   neither lost its lease (30 s) nor gave up on the device.
#[test]
fn a_hung_osd_fails_requests_after_the_op_timeout() {
    use common::raw::Client;
    use headroom_nbd::consts::{NBD_CMD_WRITE, NBD_EIO};
    use std::io::Write as _;
    use std::time::{Duration, Instant};

    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        id,
        own: Some(own),
    }) = own_cluster(scratch.path())
    else {
        return;
    };
    let client_conf = scratch.path().join("client.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!("\n[client.{id}]\nrados osd op timeout = 2\n"));
    std::fs::write(&client_conf, text).unwrap();
    let conf_arg = client_conf.to_str().unwrap().to_string();
    let flags = [
        "--rados-conf",
        conf_arg.as_str(),
        "--rados-id",
        id.as_str(),
        "--rados-pool",
        pool.as_str(),
        "--device-size",
        "1GiB",
        "--rados-lease-ms",
        "30000",
    ];
    let mut server = Server::start_with(&scratch.path().join("data"), &flags);
    server.create_volume(VOLUME, "64MiB");
    let mut client = Client::open(server.nbd, VOLUME);
    assert_eq!(client.write(1, 0, &[0xab; 4096], 0), 0);

    let paused = PausedOsd::pause(&own.dir);
    let sent = Instant::now();
    client.send_request(0, NBD_CMD_WRITE, 2, 0, 4096);
    client.stream.write_all(&[0xcd; 4096]).unwrap();
    client
        .stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let reply = client.read_simple_reply();
    let write_s = sent.elapsed().as_secs_f64();
    assert_eq!(
        (reply.cookie, reply.error),
        (2, NBD_EIO),
        "the write to a paused OSD"
    );
    let sent = Instant::now();
    assert_eq!(
        client.read(3, 0, 4096),
        Err(NBD_EIO),
        "the read from a paused OSD"
    );
    let read_s = sent.elapsed().as_secs_f64();
    eprintln!("OSD paused: write failed after {write_s:.2} s, read after {read_s:.2} s");
    for s in [write_s, read_s] {
        assert!(
            (1.5..15.0).contains(&s),
            "failed after {s:.2} s, not at the 2 s timeout"
        );
    }
    drop(paused);

    assert_eq!(client.write(4, 0, &[0xef; 4096], 0), 0);
    assert_eq!(client.read(5, 0, 4096).unwrap(), vec![0xef; 4096]);
    assert!(server.is_running());
    drop(client);
    server.stop();
}

/// `GET /v1/arbitration` of a server.
fn arbitration(server: &Server) -> Value {
    let mut response = common::agent()
        .get(format!("{}/v1/arbitration", server.api))
        .header("authorization", common::bearer())
        .call()
        .expect("GET /v1/arbitration");
    assert_eq!(response.status(), 200);
    serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap()
}

/// The node ids of a split, sorted.
fn split_nodes(status: &Value) -> Vec<String> {
    let mut ids: Vec<String> = status["nodes"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(|n| n["node_id"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

/// Cross-node arbitration with two real nodes on one pool: both report
/// and appear in the split, exactly one is the arbiter, the shares add up to the pool's
/// capacity; the arbiter is killed with SIGKILL and the other node becomes the arbiter within
/// the lock's duration plus an epoch (plus the polling's slack), then has the whole capacity
/// once the dead node's report is stale; its clean stop removes its report.
#[test]
fn two_nodes_split_the_pool_and_the_arbiter_role_survives_a_kill() {
    use std::time::{Duration, Instant};

    const EPOCH_MS: u64 = 200;
    /// The lock's default: four epochs, at least 2 s.
    const LOCK_MS: u64 = 2000;
    const IOPS: u64 = 1000;
    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        id: ceph_id,
        own: _own,
    }) = cluster(scratch.path())
    else {
        return;
    };
    // Ids of this run only: a cluster named by the environment may hold older runs' reports.
    let run = format!("{}-{}", std::process::id(), free_port());
    let ids = [format!("a-{run}"), format!("b-{run}")];
    let conf_arg = conf.to_str().unwrap().to_string();
    let start = |id: &str| {
        let flags = [
            "--rados-conf",
            &conf_arg,
            "--rados-id",
            &ceph_id,
            "--rados-pool",
            &pool,
            "--device-size",
            "1GiB",
            "--rados-arbitration",
            "--rados-capacity-iops",
            &IOPS.to_string(),
            "--rados-node-id",
            id,
            "--rados-arbitration-epoch-ms",
            &EPOCH_MS.to_string(),
        ];
        Server::start_with(&scratch.path().join(id), &flags)
    };
    let a = start(&ids[0]);
    let b = start(&ids[1]);
    let capacity = IOPS * 1000;
    let mut both = Vec::new();
    wait_until(Duration::from_secs(10), "both nodes in one split", || {
        both = vec![arbitration(&a), arbitration(&b)];
        both.iter()
            .all(|s| s["epoch"].as_u64() > Some(0) && split_nodes(s) == ids)
    });
    for s in &both {
        assert_eq!(s["enabled"], true, "{s}");
        assert_eq!(s["capacity_units_per_s"].as_u64(), Some(capacity), "{s}");
        let shares: u64 = s["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["share_units_per_s"].as_u64().unwrap())
            .sum();
        assert_eq!(shares, capacity, "the shares add up to the capacity: {s}");
    }
    // Exactly one arbiter, and both agree which.
    let arbiters: Vec<bool> = both.iter().map(|s| s["is_arbiter"] == true).collect();
    assert_eq!(arbiters.iter().filter(|&&x| x).count(), 1, "{both:?}");
    let arbiter_id = both[0]["arbiter"].as_str().unwrap().to_owned();
    wait_until(Duration::from_secs(5), "both name the same arbiter", || {
        arbitration(&b)["arbiter"].as_str() == Some(arbiter_id.as_str())
    });
    let (dead, survivor) = if arbiter_id == ids[0] { (a, b) } else { (b, a) };
    assert_eq!(arbitration(&dead)["is_arbiter"], true);
    dead.kill9();
    let killed = Instant::now();
    wait_until(
        Duration::from_millis(LOCK_MS + EPOCH_MS + 2000),
        "the survivor becomes the arbiter",
        || arbitration(&survivor)["is_arbiter"] == true,
    );
    let takeover = killed.elapsed();
    eprintln!(
        "arbiter takeover after SIGKILL: {} ms",
        takeover.as_millis()
    );
    assert!(
        takeover <= Duration::from_millis(LOCK_MS + EPOCH_MS + 500),
        "takeover took {takeover:?}"
    );
    let me = survivor_id(&arbitration(&survivor));
    wait_until(
        Duration::from_secs(5),
        "the dead node's report goes stale",
        || {
            let s = arbitration(&survivor);
            split_nodes(&s) == [me.clone()] && s["share_units_per_s"].as_u64() == Some(capacity)
        },
    );
    // The share is the node's capacity: what its scheduler paces at (GET /v1/node).
    let mut response = common::agent()
        .get(format!("{}/v1/node", survivor.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    let node: Value = serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(
        node["capacity_per_second"]["device_units"].as_u64(),
        Some(capacity),
        "{node}"
    );
    // A clean stop removes the node's report (the killed node's stays until it is stale).
    survivor.stop();
    let out = run_ok(Command::new("rados").args([
        "-c",
        &conf_arg,
        "-p",
        &pool,
        "-N",
        "headroom-cluster",
        "listomapkeys",
        "arbiter",
    ]));
    let keys = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!keys.contains(&format!("report.{me}")), "{keys}");
    assert!(keys.contains("shares"), "{keys}");
}

fn survivor_id(status: &Value) -> String {
    status["node_id"].as_str().unwrap().to_owned()
}

/// Runs the `ceph` CLI (client.admin) against the cluster of `conf`; its stdout.
fn ceph(conf: &Path, args: &[&str]) -> String {
    let out = run_ok(
        Command::new("ceph")
            .arg("-c")
            .arg(conf)
            .args(["--connect-timeout", "10"])
            .args(args),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs the `rados` CLI (client.admin) in namespace `ns` of `pool`; its stdout.
fn rados(conf: &Path, pool: &str, ns: &str, args: &[&str]) -> String {
    let out = run_ok(
        Command::new("rados")
            .arg("-c")
            .arg(conf)
            .args(["-p", pool, "-N", ns])
            .args(args),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The addresses of the live holders of the store's lease, as the OSD reports them
/// (`rados lock info`: expired holders are left out).
fn lease_holders(conf: &Path, pool: &str, ns: &str) -> Vec<String> {
    let info: Value = serde_json::from_str(&rados(
        conf,
        pool,
        ns,
        &["lock", "info", "lease", "headroom"],
    ))
    .unwrap();
    info["lockers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["addr"].as_str().unwrap().to_owned())
        .collect()
}

/// The addresses `ceph osd blocklist ls` lists.
fn blocklisted(conf: &Path) -> Vec<String> {
    blocklist_entries(conf)
        .into_iter()
        .map(|(a, _)| a)
        .collect()
}

/// `ceph osd blocklist ls`: each address with the day its entry expires (`YYYY-MM-DD`).
fn blocklist_entries(conf: &Path) -> Vec<(String, String)> {
    ceph(conf, &["osd", "blocklist", "ls"])
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let addr = words.next()?.to_owned();
            let until = words.next()?.split('T').next()?.to_owned();
            Some((addr, until))
        })
        .collect()
}

/// The day (`YYYY-MM-DD`, UTC) `days` days from now, from `date` (the system's own).
fn day_from_now(days: u32) -> String {
    let out = Command::new("date")
        .args(["-u", "-d", &format!("+{days} days"), "+%F"])
        .output()
        .expect("date");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// `GET /readyz` of a server: (status, body).
fn readyz(server: &Server) -> (u16, Value) {
    let mut response = common::agent()
        .get(format!("{}/readyz", server.api))
        .call()
        .expect("GET /readyz");
    let status = response.status().as_u16();
    let body = serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap();
    (status, body)
}

/// Fencing picks the address the OSD recorded, never one written into the pool, also when
/// the newcomer starts only after the lease expired; and a node that lost its lease says so
/// before it exits:
///
/// * node A serves a store; the test forges the omap value `owner` of the lease object
///   (where earlier releases kept the address to fence) to another address, then pauses A
///   (SIGSTOP) with a client connected;
/// * once `rados lock info` lists no holder any more (A's lease expired), node B starts: it
///   fences A's real address (in `ceph osd blocklist ls`), not the forged one, and serves the
///   data A flushed; the forged `owner` is gone;
/// * A resumes (SIGCONT) with a write from its client pending: the write is never
///   acknowledged, `/readyz` of A answers 503 naming the loss of the lease, A takes no new
///   NBD connection, and A exits with status 3 after lingering (`--rados-lease-lost-linger-ms`).
#[test]
fn the_fenced_address_is_the_one_the_osd_recorded_and_a_lost_lease_shows_in_readyz() {
    use common::raw::Client;
    use headroom_nbd::consts::NBD_CMD_WRITE;
    use std::io::Write as _;
    use std::time::{Duration, Instant};

    const LINGER_MS: u64 = 3000;
    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        id,
        own: _own,
    }) = cluster(scratch.path())
    else {
        return;
    };
    let flags = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "--rados-conf",
            conf.to_str().unwrap(),
            "--rados-id",
            &id,
            "--rados-pool",
            &pool,
            "--device-size",
            "1GiB",
            "--rados-lease-ms",
            &LEASE_MS.to_string(),
            "--rados-lease-lost-linger-ms",
            &LINGER_MS.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let strs = |v: &[String]| v.iter().map(String::as_str).collect::<Vec<_>>().join("\n");

    let a_dir = scratch.path().join("a");
    let a_flags = strs(&flags(&[]));
    let mut a = Server::start_with(&a_dir, &a_flags.lines().collect::<Vec<_>>());
    a.create_volume(VOLUME, "64MiB");
    assert_eq!(readyz(&a).0, 200);
    let ns = std::fs::read_to_string(a_dir.join("rados-namespace"))
        .unwrap()
        .trim()
        .to_string();
    let mut on_a = Client::open(a.nbd, VOLUME);
    assert_eq!(on_a.write(1, 0, &[0xa1; 4096], 0), 0);
    assert_eq!(on_a.flush(2), 0);
    let holders = lease_holders(&conf, &pool, &ns);
    assert_eq!(holders.len(), 1, "{holders:?}");
    let a_addr = holders[0].clone();
    // Any other address would do: this one looks like a client of the same machine, with a
    // nonce of this run (a shared cluster keeps blocklist entries for an hour).
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let forged = format!("127.0.0.1:0/{}", 1 + nanos % 1_000_000_000);
    let forged = forged.as_str();
    assert!(!blocklisted(&conf).iter().any(|f| f == forged));
    rados(&conf, &pool, &ns, &["setomapval", "lease", "owner", forged]);

    signal(&a, "STOP");
    let paused = Instant::now();
    wait_until(
        Duration::from_secs(60),
        "A's lease expires (no live holder)",
        || lease_holders(&conf, &pool, &ns).is_empty(),
    );
    let b_flags = strs(&flags(&["--rados-namespace", &ns]));
    let b = Server::start_with(
        &scratch.path().join("b"),
        &b_flags.lines().collect::<Vec<_>>(),
    );
    eprintln!(
        "B started {:.1} s after A was paused (lease {LEASE_MS} ms)",
        paused.elapsed().as_secs_f64()
    );
    // B never saw A hold the lock: it read the expired holder from the lock's raw state.
    assert!(!b.log().contains("held by another node"), "{}", b.log());
    assert!(b.log().contains("fenced it (blocklisted)"), "{}", b.log());
    let fenced = blocklisted(&conf);
    assert!(fenced.contains(&a_addr), "A ({a_addr}) not in {fenced:?}");
    // For 30 days (the blocklist must outlast any pause A could wake up from), not an hour.
    let until = blocklist_entries(&conf)
        .into_iter()
        .find_map(|(addr, until)| (addr == a_addr).then_some(until));
    let (earliest, latest) = (day_from_now(29), day_from_now(31));
    assert!(
        until
            .as_ref()
            .is_some_and(|u| *u >= earliest && *u <= latest),
        "A's entry expires {until:?}, not in 30 days"
    );
    assert!(
        !fenced.iter().any(|f| f == forged),
        "forged {forged} in {fenced:?}"
    );
    let keys = rados(&conf, &pool, &ns, &["listomapkeys", "lease"]);
    assert!(!keys.lines().any(|k| k == "owner"), "{keys}");
    let mut on_b = Client::open(b.nbd, VOLUME);
    assert_eq!(on_b.read(3, 0, 4096).unwrap(), vec![0xa1; 4096]);

    // A's late write, then A resumes.
    on_a.send_request(0, NBD_CMD_WRITE, 4, 0, 4096);
    on_a.stream.write_all(&[0xa2; 4096]).unwrap();
    signal(&a, "CONT");
    let replies = replies_until_closed(&mut on_a);
    assert!(
        !replies
            .iter()
            .any(|&(cookie, error)| cookie == 4 && error == 0),
        "the fenced node acknowledged a write: {replies:?}"
    );
    let mut seen = None;
    wait_until(Duration::from_secs(30), "A's /readyz answers 503", || {
        let (status, body) = readyz(&a);
        let done = status == 503;
        seen = Some((status, body, a.is_running()));
        done
    });
    let (_, body, running) = seen.unwrap();
    eprintln!("A's /readyz after the loss: {body}");
    assert!(running, "A had exited before /readyz could say why");
    assert_eq!(body["status"], "not_ready", "{body}");
    let why = body["lease_lost"]["why"].as_str().unwrap_or_default();
    assert!(!why.is_empty(), "{body}");
    assert!(
        body["lease_lost"]["at"].as_str().unwrap().ends_with('Z'),
        "{body}"
    );
    assert!(
        body["reasons"][0]
            .as_str()
            .unwrap()
            .contains("lost the store's lease"),
        "{body}"
    );
    let metrics = common::metrics_text(&a.api);
    assert!(
        metrics.lines().any(|l| l == "headroom_metadata_ready 0"),
        "{metrics}"
    );
    // No new NBD connection is served: the listener is closed (or closes it at once).
    let refused = match std::net::TcpStream::connect(a.nbd) {
        Err(_) => true,
        Ok(mut s) => {
            use std::io::Read as _;
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut buf = [0u8; 16];
            // An open listener would send the NBD greeting (16 bytes or more).
            !matches!(s.read(&mut buf), Ok(n) if n > 0)
        }
    };
    assert!(
        refused,
        "A still takes NBD connections after losing its lease"
    );
    wait_until(
        Duration::from_millis(LINGER_MS) + Duration::from_secs(20),
        "A exits after lingering",
        || !a.is_running(),
    );
    assert_eq!(
        a.exit_status().and_then(|s| s.code()),
        Some(headroom_store::LEASE_LOST_EXIT_STATUS),
        "{}",
        a.log()
    );
    // B's data: what A flushed, not A's late write.
    assert_eq!(on_b.read(5, 0, 4096).unwrap(), vec![0xa1; 4096]);
    drop((on_a, on_b));
    let out = b.cli(&["volume", "delete", VOLUME]);
    assert!(out.status.success(), "{}", text(&out));
    b.stop();
}

/// A node whose cephx user lacks a cap it needs fails at start with the RADOS error, at
/// once: a user with every documented cap but `class lock` (the lease's lock calls), and one
/// without `class-read` (the commits' lock assertion).
#[test]
fn a_user_without_the_lock_cap_is_refused_at_start() {
    refused_at_start_with_osd_caps(
        "nolock",
        "allow rw class-read pool={pool} namespace=headroom-*",
        "RADOS lock: Operation not permitted",
    );
}

#[test]
fn a_user_without_class_read_is_refused_at_start() {
    refused_at_start_with_osd_caps(
        "noclsread",
        "allow rw pool={pool} namespace=headroom-*, allow pool={pool} namespace=headroom-* class lock",
        "allow rw class-read pool=POOL namespace=headroom-*",
    );
}

/// Starts a node as a fresh user with osd caps `osd_caps` (`{pool}` replaced) and the
/// documented mon caps; asserts it fails at start, within 20 s, printing `refusal`.
fn refused_at_start_with_osd_caps(tag: &str, osd_caps: &str, refusal: &str) {
    use std::time::{Duration, Instant};

    let scratch = tempfile::tempdir().unwrap();
    let Some(Ceph {
        conf,
        pool,
        own: _own,
        ..
    }) = cluster(scratch.path())
    else {
        return;
    };
    let user = format!("headroom-{tag}-{}", std::process::id());
    let keyring = scratch.path().join(format!("{tag}.keyring"));
    let key = ceph(
        &conf,
        &[
            "auth",
            "get-or-create",
            &format!("client.{user}"),
            "mon",
            "allow r, allow command \"osd blocklist\" with blocklistop=add",
            "osd",
            &osd_caps.replace("{pool}", &pool),
        ],
    );
    std::fs::write(&keyring, key).unwrap();
    let client_conf = scratch.path().join("client.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!(
        "\n[client.{user}]\nkeyring = {}\n",
        keyring.display()
    ));
    std::fs::write(&client_conf, text).unwrap();
    let flags: Vec<String> = [
        "--rados-conf",
        client_conf.to_str().unwrap(),
        "--rados-id",
        &user,
        "--rados-pool",
        &pool,
        "--device-size",
        "1GiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let started = Instant::now();
    serve_refuses(&scratch.path().join("data"), &flags, refusal);
    let took = started.elapsed();
    ceph(&conf, &["auth", "rm", &format!("client.{user}")]);
    assert!(
        took < Duration::from_secs(20),
        "refused only after {took:?}"
    );
}
