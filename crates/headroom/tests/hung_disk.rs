//! A disk that stops answering makes the node unready, within seconds, and ready again once
//! it answers. The server's data directory sits on a real FUSE mount (`fuse-overlayfs`, a
//! passthrough of its upper directory); a client writes and FLUSHes, writes more, then the
//! FUSE daemon is stopped with SIGSTOP, so every I/O on the mount hangs as on a hung NFS or
//! iSCSI mount, a dying disk or a FUSE daemon that stopped. The next FLUSH hangs in its
//! commit's device sync, and `GET /readyz` must answer 503 naming the hung metadata commit
//! within a few seconds (each answer within its bound: it does no I/O), while `/healthz` stays
//! 200 and `/metrics` says `headroom_metadata_ready 0`. After SIGCONT the FLUSH succeeds,
//! every byte written before reads back, and `/readyz` is 200 again without a restart. The
//! measured times are printed.
//!
//! Needs `fuse-overlayfs` and `fusermount3` (skips otherwise, fails under
//! HEADROOM_REQUIRE_TOOLS=1; scripts/test installs both). A guard resumes the daemon,
//! kills the server by PID and unmounts on every path, also when the test fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::raw::Client;
use common::{Server, agent, have_tool, report};

const MIB: usize = 1 << 20;
/// How long the hung commit may take to show in `/readyz`: the store's bound (2 s) and
/// a loaded machine's scheduling.
const UNREADY_WITHIN: Duration = Duration::from_secs(10);
/// How long one `/readyz` answer may take: its own bound is 2 s.
const ANSWER_WITHIN: Duration = Duration::from_secs(3);
/// How long anything may take once the disk answers again.
const RECOVERED_WITHIN: Duration = Duration::from_secs(30);
/// The reason `/readyz` gives for a hung commit.
const HUNG_REASON: &str = "a metadata commit has not finished for ";

/// A `fuse-overlayfs` mount run in the foreground (its PID is the daemon's). Dropping it
/// resumes the daemon (it may be stopped), unmounts, and waits for the daemon to exit.
struct FuseMount {
    daemon: Child,
    dir: PathBuf,
}

impl FuseMount {
    /// Mounts `lower` and `upper` (with `work`) at `dir`; waits until the mount is there.
    fn new(root: &Path) -> FuseMount {
        let [lower, upper, work, dir] = ["lower", "upper", "work", "mnt"].map(|d| root.join(d));
        for d in [&lower, &upper, &work, &dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        let daemon = Command::new("fuse-overlayfs")
            .args(["-f", "-o", &options])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start fuse-overlayfs");
        let mut mount = FuseMount { daemon, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !mount.is_mounted() {
            if let Ok(Some(status)) = mount.daemon.try_wait() {
                panic!("fuse-overlayfs exited with {status} before mounting");
            }
            assert!(Instant::now() < deadline, "fuse-overlayfs did not mount");
            std::thread::sleep(Duration::from_millis(10));
        }
        mount
    }

    fn is_mounted(&self) -> bool {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let dir = self.dir.to_string_lossy();
        mounts
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(dir.as_ref()))
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.daemon.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} fuse-overlayfs");
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.daemon.id().to_string()])
            .status();
        let unmounted = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.dir)
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(self.daemon.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

/// The daemon stopped (SIGSTOP) until this is dropped or resumed (SIGCONT): declared after
/// the server, so that a failing test resumes the disk before the server is killed.
struct Stopped<'a>(Option<&'a FuseMount>);

impl Stopped<'_> {
    fn resume(mut self) {
        if let Some(mount) = self.0.take() {
            mount.signal("CONT");
        }
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        if let Some(mount) = self.0.take() {
            let _ = Command::new("kill")
                .args(["-CONT", &mount.daemon.id().to_string()])
                .status();
        }
    }
}

/// `GET path` without a token (`/readyz`, `/healthz`): status, body, and how long it took.
fn probe(server: &Server, path: &str) -> (u16, String, Duration) {
    let asked = Instant::now();
    let mut response = agent()
        .get(format!("{}{path}", server.api))
        .call()
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string().unwrap_or_default();
    (status, body, asked.elapsed())
}

/// `len` bytes of a pattern that differs with `seed` and the offset.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect()
}

#[test]
fn a_disk_that_stops_answering_makes_readyz_503_until_it_answers() {
    if !have_tool("fuse-overlayfs") || !have_tool("fusermount3") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mount = FuseMount::new(tmp.path());
    // The data directory is the mount itself: the server's log (`<dir>.log`) stays outside.
    let server = Server::start_with(&mount.dir, &["--devices", "1", "--device-size", "1GiB"]);
    server.create_volume("v", "64MiB");

    let (first, second) = (pattern(1, MIB), pattern(2, MIB));
    let mut client = Client::open(server.nbd, "v");
    assert_eq!(client.write(1, 0, &first, 0), 0);
    assert_eq!(client.flush(2), 0, "the first FLUSH");
    // Written, not flushed: the next FLUSH has a device to sync and an extent to commit.
    assert_eq!(client.write(3, 8 * MIB as u64, &second, 0), 0);
    let (status, body, _) = probe(&server, "/readyz");
    assert_eq!(status, 200, "/readyz before the disk stops: {body}");

    // The disk stops answering; the FLUSH hangs in its commit.
    let stopped = Stopped(Some(&mount));
    mount.signal("STOP");
    let flush_sent = Instant::now();
    let (flushed_tx, flushed) = std::sync::mpsc::channel();
    let flusher = std::thread::spawn(move || {
        let error = client.flush(4);
        let _ = flushed_tx.send(error);
        client
    });

    let mut slowest_answer = Duration::ZERO;
    let (body, unready_after) = loop {
        let (status, body, took) = probe(&server, "/readyz");
        slowest_answer = slowest_answer.max(took);
        assert!(
            took < ANSWER_WITHIN,
            "/readyz took {took:?} while the disk hung: {status} {body}"
        );
        if status == 503 && body.contains(HUNG_REASON) {
            break (body, flush_sent.elapsed());
        }
        assert!(
            flush_sent.elapsed() < UNREADY_WITHIN,
            "/readyz did not name the hung commit within {UNREADY_WITHIN:?}: {status} {body}"
        );
        assert!(
            flushed.try_recv().is_err(),
            "the FLUSH answered while the disk was stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let (health, health_body, _) = probe(&server, "/healthz");
    assert_eq!(health, 200, "/healthz while the disk hangs: {health_body}");
    // The metrics' gauge reads the same start time.
    let scraped = Instant::now();
    let metrics = common::metrics_text(&server.api);
    let scrape_took = scraped.elapsed();
    assert!(
        metrics.lines().any(|l| l == "headroom_metadata_ready 0"),
        "headroom_metadata_ready while the disk hangs: {:?}",
        metrics
            .lines()
            .find(|l| l.starts_with("headroom_metadata_ready "))
    );
    assert!(
        flushed.try_recv().is_err(),
        "the FLUSH answered while the disk was stopped"
    );
    let stopped_for = flush_sent.elapsed();

    // The disk answers again: the FLUSH completes, the node is ready, the data is there.
    let resumed = Instant::now();
    stopped.resume();
    let error = flushed
        .recv_timeout(RECOVERED_WITHIN)
        .expect("the FLUSH did not complete after the disk answered again");
    let flush_done_after = resumed.elapsed();
    assert_eq!(error, 0, "the hung FLUSH's answer");
    let mut client = flusher.join().unwrap();
    let ready_after = loop {
        let (status, body, _) = probe(&server, "/readyz");
        if status == 200 {
            break resumed.elapsed();
        }
        assert!(
            resumed.elapsed() < RECOVERED_WITHIN,
            "/readyz not ready again after the disk answered: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(client.read(5, 0, MIB as u32).unwrap() == first, "first MiB");
    assert!(
        client.read(6, 8 * MIB as u64, MIB as u32).unwrap() == second,
        "second MiB"
    );
    client.disconnect();

    report(&format!(
        "hung disk: /readyz 503 naming the hung commit {unready_after:?} after the FLUSH \
         (slowest /readyz answer {slowest_answer:?}; /metrics with headroom_metadata_ready 0 in \
         {scrape_took:?}); disk stopped for {stopped_for:?}; after \
         SIGCONT the FLUSH answered in {flush_done_after:?} and /readyz was 200 in \
         {ready_after:?}; body: {body}"
    ));
    server.stop();
    drop(mount);
}
