//! A server process the lab started, stopped by PID when its guard is dropped: SIGTERM, then
//! SIGKILL after a grace period.
//!
//! Why a guard: every server and peer a run starts must be gone at the end of its row, also
//! when the row fails half-way (an early `?` drops the guard, which stops the process), and a
//! process is only ever stopped by its own PID, never by name.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::RunError;

/// How long a server may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// A child process stopped by PID when dropped: SIGTERM, then SIGKILL after a grace period.
#[derive(Debug)]
pub struct ChildGuard {
    pub(crate) child: Option<Child>,
    /// What it is, for messages.
    pub name: String,
    pub log_path: PathBuf,
}

impl ChildGuard {
    pub fn new(child: Child, name: &str, log_path: PathBuf) -> ChildGuard {
        ChildGuard {
            child: Some(child),
            name: name.to_string(),
            log_path,
        }
    }

    /// A guard of nothing (a server the lab did not start).
    pub fn detached() -> ChildGuard {
        ChildGuard {
            child: None,
            name: String::new(),
            log_path: PathBuf::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The last lines of its log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Whether it has exited (and how).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM, wait, SIGKILL if it lingers. Returns its exit status.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        signal(child.id(), rustix::process::Signal::TERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    let _ = child.kill();
                    return child.wait().ok();
                }
            }
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// Starts `program args` with stdout and stderr in `dir/NAME.log`.
pub(crate) fn spawn(
    dir: &Path,
    name: &str,
    program: &str,
    args: &[String],
) -> Result<ChildGuard, RunError> {
    let log_path = dir.join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path)
        .map_err(RunError::io(format!("creating {}", log_path.display())))?;
    let err = log
        .try_clone()
        .map_err(RunError::io(format!("opening {}", log_path.display())))?;
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(RunError::io(format!(
            "starting {program} (is it installed?)"
        )))?;
    Ok(ChildGuard::new(child, name, log_path))
}
