//! A real Linux guest whose disk is a Headroom volume: QEMU (TCG: CI machines have no nested
//! KVM) boots the kernel and busybox initramfs that scripts/build-guest builds, with the disk
//! the test hands it ([`Disk`]), and the guest's /init (scripts/guest/init) runs the phase the
//! kernel command line names and powers off. The test reads the `HR-*` lines the guest prints
//! on its serial console ([`GuestRun`]).
//!
//! The launcher takes the disk as QEMU arguments so a new transport is one constructor:
//! [`Disk::nbd_tcp`] and [`Disk::nbd_unix`] today, [`Disk::vhost_user_blk`] for a
//! vhost-user-blk backend (guest memory must then be a shared memfd, which the disk brings).
//! QEMU is started and killed by its PID; a dropped [`Guest`] (a failed test) kills it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use super::{have_tool, signal};

/// The QEMU binary the guest runs in.
pub const QEMU: &str = "qemu-system-x86_64";

/// Guest memory, MiB, when the disk does not need more: the kernel plus the initramfs.
const DEFAULT_MEMORY_MIB: u32 = 256;

/// The directory with the built guest (`vmlinuz`, `initrd.img`): `HEADROOM_GUEST_DIR` when set
/// (scripts/test builds the guest before the tests and sets it), else what
/// `scripts/build-guest` prints (cached after the first build). `None`, with the reason
/// printed, when it cannot be had; a failure under HEADROOM_REQUIRE_TOOLS.
pub fn guest_dir() -> Option<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("HEADROOM_GUEST_DIR") {
            return Ok(PathBuf::from(dir));
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-guest");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .map_err(|err| format!("running {}: {err}", script.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        match stdout
            .lines()
            .find_map(|line| line.strip_prefix("HEADROOM_GUEST_DIR="))
        {
            Some(dir) if out.status.success() => Ok(PathBuf::from(dir)),
            _ => Err(format!("scripts/build-guest failed: {}", out.status)),
        }
    });
    let reason = match found {
        Ok(dir) if dir.join("vmlinuz").exists() && dir.join("initrd.img").exists() => {
            return Some(dir.clone());
        }
        Ok(dir) => format!("{} has no vmlinuz and initrd.img", dir.display()),
        Err(reason) => reason.clone(),
    };
    if std::env::var_os("HEADROOM_REQUIRE_TOOLS").is_some() {
        panic!("the guest is required (HEADROOM_REQUIRE_TOOLS is set): {reason}");
    }
    eprintln!("SKIPPED: no Linux guest ({reason}; scripts/build-guest builds it)");
    None
}

/// True when QEMU and the guest are both available (see [`have_tool`] and [`guest_dir`]).
pub fn can_boot() -> bool {
    have_tool(QEMU) && guest_dir().is_some()
}

/// The guest's disk as QEMU arguments (it appears in the guest as /dev/vda).
pub struct Disk {
    /// Human-readable, for messages: `nbd tcp 127.0.0.1:PORT/vm`.
    pub describe: String,
    args: Vec<String>,
    memory_mib: u32,
}

impl Disk {
    /// QEMU's NBD client on TCP, `O_DIRECT`-like (no host cache), as virtio-blk with 2 queues.
    pub fn nbd_tcp(server: SocketAddr, export: &str) -> Disk {
        Self::nbd(
            format!(
                "server.type=inet,server.host={},server.port={}",
                server.ip(),
                server.port()
            ),
            export,
            format!("nbd tcp {server}/{export}"),
        )
    }

    /// QEMU's NBD client on the server's Unix socket (`serve --nbd-unix PATH`).
    pub fn nbd_unix(socket: &Path, export: &str) -> Disk {
        Self::nbd(
            format!("server.type=unix,server.path={}", socket.display()),
            export,
            format!("nbd unix {}/{export}", socket.display()),
        )
    }

    fn nbd(server: String, export: &str, describe: String) -> Disk {
        Disk {
            describe,
            args: vec![
                "-blockdev".into(),
                format!("driver=nbd,node-name=d0,{server},export={export},cache.direct=on"),
                "-device".into(),
                "virtio-blk-pci,drive=d0,num-queues=2".into(),
            ],
            memory_mib: DEFAULT_MEMORY_MIB,
        }
    }

    /// A vhost-user-blk backend listening on `socket`: the guest's memory is a shared memfd
    /// (the backend maps it to reach the virtqueues and buffers).
    pub fn vhost_user_blk(socket: &Path) -> Disk {
        let memory_mib = 384;
        Disk {
            describe: format!("vhost-user-blk {}", socket.display()),
            args: vec![
                "-object".into(),
                format!("memory-backend-memfd,id=mem,size={memory_mib}M,share=on"),
                "-numa".into(),
                "node,memdev=mem".into(),
                "-chardev".into(),
                format!("socket,id=c0,path={}", socket.display()),
                "-device".into(),
                "vhost-user-blk-pci,chardev=c0,num-queues=2".into(),
            ],
            memory_mib,
        }
    }
}

/// A running QEMU. Dropping it kills QEMU (by PID) if it is still running.
pub struct Guest {
    pid: u32,
    exited: Receiver<std::io::Result<ExitStatus>>,
    reaped: bool,
    console_path: PathBuf,
    started: Instant,
    describe: String,
    /// Held until the guest is gone ([`ONE_GUEST`]).
    _alone: std::sync::MutexGuard<'static, ()>,
}

/// One guest at a time in a test binary: a TCG guest takes a whole core, and the QoS test's
/// guest has to drive its 1,000 IOPS second by second; with the other tests' guests booting
/// beside it on a 2-core machine it could fall short and fail for the wrong reason.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Guest {
    /// Boots the guest on `disk` with `phase` and `params` (`hr.NAME=VALUE` each) on the kernel
    /// command line; the serial console goes to `console_path`.
    pub fn boot(disk: &Disk, phase: &str, params: &[(&str, String)], console_path: &Path) -> Guest {
        let dir = guest_dir().expect("the guest is built (check can_boot first)");
        let alone = ONE_GUEST.lock().unwrap_or_else(|e| e.into_inner());
        let mut cmdline = format!("console=ttyS0 quiet panic=-1 hr.phase={phase}");
        for (name, value) in params {
            cmdline.push_str(&format!(" hr.{name}={value}"));
        }
        let mut child = Command::new(QEMU)
            .args([
                "-accel",
                "tcg",
                "-smp",
                "1",
                "-nodefaults",
                "-no-user-config",
            ])
            .args(["-display", "none", "-no-reboot"])
            .args(["-m", &format!("{}M", disk.memory_mib)])
            .arg("-serial")
            .arg(format!("file:{}", console_path.display()))
            .arg("-kernel")
            .arg(dir.join("vmlinuz"))
            .arg("-initrd")
            .arg(dir.join("initrd.img"))
            .args(["-append", &cmdline])
            .args(&disk.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(console_path.with_extension("qemu-stderr"))
                    .expect("create QEMU's stderr file"),
            ))
            .spawn()
            .unwrap_or_else(|err| panic!("starting {QEMU}: {err}"));
        let pid = child.id();
        let (tx, exited) = channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait());
        });
        Guest {
            pid,
            exited,
            reaped: false,
            console_path: console_path.to_path_buf(),
            started: Instant::now(),
            describe: format!("{phase} on {}", disk.describe),
            _alone: alone,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the guest to power off (QEMU exits); `limit` only guards against a hung
    /// guest: past it QEMU is killed and the test fails with the console so far.
    pub fn wait(mut self, limit: Duration) -> GuestRun {
        let status = self.exited.recv_timeout(limit);
        let console = std::fs::read_to_string(&self.console_path).unwrap_or_default();
        let stderr = std::fs::read_to_string(self.console_path.with_extension("qemu-stderr"))
            .unwrap_or_default();
        match status {
            Ok(Ok(status)) => {
                self.reaped = true;
                assert!(
                    status.success(),
                    "QEMU ({}) exited with {status}\nstderr:\n{stderr}\nconsole:\n{console}",
                    self.describe
                );
                GuestRun {
                    console,
                    took: self.started.elapsed(),
                }
            }
            Ok(Err(err)) => panic!("waiting for QEMU: {err}"),
            Err(_) => panic!(
                "the guest ({}) did not power off within {limit:?}\nstderr:\n{stderr}\nconsole:\n{console}",
                self.describe
            ),
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if !self.reaped {
            signal(self.pid, "KILL");
            let _ = self.exited.recv_timeout(Duration::from_secs(10));
        }
    }
}

/// What a guest printed on its console.
pub struct GuestRun {
    pub console: String,
    /// From QEMU's start to its exit.
    pub took: Duration,
}

impl GuestRun {
    /// The words of the `HR-RESULT` line after `HR-RESULT` (`ok phase=write ...`); panics
    /// with the console when there is none.
    pub fn result(&self) -> Vec<String> {
        let line = self
            .lines("HR-RESULT")
            .pop()
            .unwrap_or_else(|| panic!("no HR-RESULT line; console:\n{}", self.console));
        line.split_whitespace().map(str::to_string).collect()
    }

    /// Asserts the run ended with `HR-RESULT ok` (the console in the message otherwise).
    pub fn assert_ok(&self) {
        let result = self.result();
        assert_eq!(
            result.first().map(String::as_str),
            Some("ok"),
            "the guest failed: {result:?}\nconsole:\n{}",
            self.console
        );
    }

    /// The rest of every console line that starts with `tag ` (serial consoles end lines
    /// with `\r\n`).
    pub fn lines(&self, tag: &str) -> Vec<String> {
        let prefix = format!("{tag} ");
        self.console
            .lines()
            .filter_map(|line| line.trim_end_matches('\r').split_once(&prefix))
            .map(|(_, rest)| rest.to_string())
            .collect()
    }

    /// The `HR-FILE` lines: `(sha256, file name)`, in the order printed.
    pub fn files(&self) -> Vec<(String, String)> {
        self.lines("HR-FILE")
            .iter()
            .filter_map(|line| {
                let (sum, name) = line.split_once(char::is_whitespace)?;
                Some((sum.to_string(), name.trim().to_string()))
            })
            .collect()
    }
}
