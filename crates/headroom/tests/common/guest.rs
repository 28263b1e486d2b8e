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
        Disk::vhost_user_blk_with(socket, "")
    }

    /// [`Disk::vhost_user_blk`] whose QEMU reconnects (every 100 ms) when the backend goes
    /// away, so the guest keeps running while the backend restarts.
    pub fn vhost_user_blk_reconnecting(socket: &Path) -> Disk {
        Disk::vhost_user_blk_with(socket, ",reconnect-ms=100")
    }

    /// [`Disk::vhost_user_blk`] with rings of 32 entries: the guest's largest requests are
    /// longer than the ring, and only indirect descriptors let it queue them.
    pub fn vhost_user_blk_small_rings(socket: &Path) -> Disk {
        let mut disk = Disk::vhost_user_blk(socket);
        if let Some(device) = disk.args.last_mut() {
            device.push_str(",queue-size=32");
        }
        disk.describe.push_str(" (rings of 32)");
        disk
    }

    fn vhost_user_blk_with(socket: &Path, chardev_options: &str) -> Disk {
        let memory_mib = 384;
        Disk {
            describe: format!("vhost-user-blk {}", socket.display()),
            args: vec![
                "-object".into(),
                format!("memory-backend-memfd,id=mem,size={memory_mib}M,share=on"),
                "-numa".into(),
                "node,memdev=mem".into(),
                "-chardev".into(),
                format!("socket,id=c0,path={}{chardev_options}", socket.display()),
                "-device".into(),
                "vhost-user-blk-pci,chardev=c0,num-queues=2".into(),
            ],
            memory_mib,
        }
    }
}

/// What the server behind a guest's disk is doing, for the message of a guest that hung.
pub type HangReport = Box<dyn Fn() -> String + Send>;

/// A running QEMU. Dropping it kills QEMU (by PID) if it is still running.
pub struct Guest {
    pid: u32,
    exited: Receiver<std::io::Result<ExitStatus>>,
    reaped: bool,
    console_path: PathBuf,
    started: Instant,
    describe: String,
    /// What the server behind the disk says when the guest hangs ([`Guest::report_on_hang`]).
    hang_report: Option<HangReport>,
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
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                console_path.with_extension("qmp").display()
            ))
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
            hang_report: None,
            _alone: alone,
        }
    }

    /// Adds `report` (the backend's side: its queues, its log) to the message of a hang.
    pub fn report_on_hang(&mut self, report: HangReport) {
        self.hang_report = Some(report);
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The driver's available index and the device's used index of queue `queue` of the
    /// guest's vhost-user-blk device, read from guest memory: chains the backend has not
    /// returned are the difference.
    pub fn vhost_ring_indices(&self, queue: u64) -> std::io::Result<(u16, u16)> {
        let mut qmp = Qmp::connect(&self.console_path.with_extension("qmp"))?;
        let devices = qmp.execute("x-query-virtio", serde_json::json!({}))?;
        let path = devices
            .as_array()
            .and_then(|all| all.iter().find(|d| d["name"] == "virtio-blk"))
            .map(|d| d["path"].clone())
            .ok_or_else(|| std::io::Error::other(format!("no vhost-user-blk in {devices}")))?;
        let ring = qmp.execute(
            "x-query-virtio-vhost-queue-status",
            serde_json::json!({"path": path, "queue": queue}),
        )?;
        let address = |name: &str| {
            ring[name]
                .as_u64()
                .ok_or_else(|| std::io::Error::other(format!("no {name} in {ring}")))
        };
        // The split ring's `idx` is the second 16-bit word of the avail and used rings.
        let avail = qmp.guest_u16(address("avail-phys")? + 2)?;
        let used = qmp.guest_u16(address("used-phys")? + 2)?;
        Ok((avail, used))
    }

    /// Waits until the console has a line `line` (the guest announcing a point of its phase),
    /// at most `limit`; whether it came. Reads the console file every 20 ms: the file is
    /// where QEMU puts the serial port, and the line is the event waited for.
    pub fn wait_for_line(&self, line: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let console = std::fs::read_to_string(&self.console_path).unwrap_or_default();
            if console.lines().any(|l| l.trim_end_matches('\r') == line) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
            Err(_) => {
                // The backend first: nothing QEMU is asked below reaches it.
                let backend = self
                    .hang_report
                    .as_ref()
                    .map(|report| report())
                    .unwrap_or_default();
                let queues = virtio_queues(&self.console_path.with_extension("qmp"));
                panic!(
                    "the guest ({}) did not power off within {limit:?}\nvirtqueues (QMP):\n{queues}\nthe backend:\n{backend}\nstderr:\n{stderr}\nconsole:\n{console}",
                    self.describe
                )
            }
        }
    }
}

/// A QMP connection to a guest's QEMU (`-qmp unix:…`): commands and their answers, each
/// read bounded by a timeout.
struct Qmp {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
}

impl Qmp {
    fn connect(path: &Path) -> std::io::Result<Qmp> {
        let stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut qmp = Qmp {
            reader: std::io::BufReader::new(stream.try_clone()?),
            writer: stream,
        };
        qmp.execute("qmp_capabilities", serde_json::json!({}))?;
        Ok(qmp)
    }

    /// Runs `command`; its `return` (an `error` answer is an error).
    fn execute(
        &mut self,
        command: &str,
        arguments: serde_json::Value,
    ) -> std::io::Result<serde_json::Value> {
        use std::io::{BufRead, Write};
        let request = serde_json::json!({"execute": command, "arguments": arguments});
        writeln!(self.writer, "{request}")?;
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(std::io::Error::other("QMP closed"));
            }
            let mut value: serde_json::Value =
                serde_json::from_str(&line).map_err(std::io::Error::other)?;
            // Skip the greeting and asynchronous events.
            if let Some(error) = value.get("error") {
                return Err(std::io::Error::other(format!("{command}: {error}")));
            }
            if let Some(answer) = value.get_mut("return") {
                return Ok(answer.take());
            }
        }
    }

    /// A 16-bit word of guest memory at the physical address `at` (HMP's `xp`).
    fn guest_u16(&mut self, at: u64) -> std::io::Result<u16> {
        let out = self.execute(
            "human-monitor-command",
            serde_json::json!({"command-line": format!("xp /1hx {at:#x}")}),
        )?;
        // "00000000000ff002: 0x00cc"
        let text = out.as_str().unwrap_or_default();
        text.rsplit("0x")
            .next()
            .and_then(|hex| u16::from_str_radix(hex.trim(), 16).ok())
            .ok_or_else(|| std::io::Error::other(format!("xp answered {text:?}")))
    }
}

/// What QEMU says of every virtio device's queues (the indices in the rings, and for a vhost
/// device what the backend last reported): the first thing to read when a guest's I/O stops.
/// An error is part of the text, never a panic.
///
/// A vhost device is asked only `x-query-virtio-vhost-queue-status` and its rings are read
/// from guest memory: QEMU answers `x-query-virtio-queue-status` for a started vhost device
/// by sending the backend `GET_VRING_BASE`, which stops the ring being looked at.
fn virtio_queues(qmp: &Path) -> String {
    let ask = || -> std::io::Result<String> {
        let mut qmp = Qmp::connect(qmp)?;
        let mut text = String::new();
        let devices = qmp.execute("x-query-virtio", serde_json::json!({}))?;
        for device in devices.as_array().cloned().unwrap_or_default() {
            let path = device["path"].clone();
            let status = qmp.execute("x-query-virtio-status", serde_json::json!({"path": path}))?;
            let queues = status["num-vqs"].as_u64().unwrap_or(1);
            let vhost = status.get("vhost-dev").is_some();
            text.push_str(&format!(
                "{device} status {} started {} vhost started {} broken {}\n",
                status["status"], status["started"], status["vhost-started"], status["broken"]
            ));
            let command = if vhost {
                "x-query-virtio-vhost-queue-status"
            } else {
                "x-query-virtio-queue-status"
            };
            for queue in 0..queues {
                let state = qmp
                    .execute(command, serde_json::json!({"path": path, "queue": queue}))
                    .unwrap_or_else(|err| serde_json::json!(err.to_string()));
                text.push_str(&format!("  {command} {queue}: {state}\n"));
                if vhost {
                    text.push_str(&ring_words(&mut qmp, &state));
                }
            }
        }
        Ok(text)
    };
    ask().unwrap_or_else(|err| format!("(QMP at {}: {err})", qmp.display()))
}

/// The split ring's words in guest memory of a vhost queue whose `state` QEMU reported: the
/// driver's flags, available index and used_event, the device's flags, used index and
/// avail_event (what the backend sees; QEMU's own indices are stale under vhost).
fn ring_words(qmp: &mut Qmp, state: &serde_json::Value) -> String {
    let (Some(avail), Some(used), Some(num)) = (
        state["avail-phys"].as_u64(),
        state["used-phys"].as_u64(),
        state["num"].as_u64(),
    ) else {
        return String::new();
    };
    if avail == 0 || used == 0 {
        return String::new();
    }
    let mut word = |at: u64| {
        qmp.guest_u16(at)
            .map_or_else(|err| format!("({err})"), |w| w.to_string())
    };
    format!(
        "    in guest memory: avail flags {} idx {} used_event {}; used flags {} idx {} avail_event {}\n",
        word(avail),
        word(avail + 2),
        word(avail + 4 + 2 * num),
        word(used),
        word(used + 2),
        word(used + 4 + 8 * num),
    )
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
