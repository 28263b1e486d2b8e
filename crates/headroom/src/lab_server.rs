//! `headroom lab run`, part two: the servers a run measures. Headroom itself (this binary's
//! `serve`, one process per policy so each policy starts from the same empty state) and the
//! peers, each started with its own configuration on free loopback ports and stopped by PID
//! at the end, also when the run fails (the guard's `Drop`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use headroom_node::api::{ApiToken, CreateVolume};
use headroom_qos::QosSpec;

use crate::client::Api;
use crate::token;

/// How long a server may take to print its addresses.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// A child process stopped by PID when dropped: SIGTERM, then SIGKILL after a grace period.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
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
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM, wait, SIGKILL if it lingers. Returns its exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
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

/// A Headroom server started by the lab.
pub struct HeadroomServer {
    pub guard: ChildGuard,
    pub nbd: String,
    pub api: Api,
    pub api_url: String,
}

/// A fresh random token for the servers the lab starts (they listen on loopback only and
/// only for the run; it keeps the API's authentication on, as in production).
pub fn lab_token() -> Result<String> {
    Ok(ApiToken::random()
        .map_err(|e| anyhow::anyhow!("API token: {e}"))?
        .expose()
        .to_string())
}

/// Starts `headroom serve --config CONFIG --policy POLICY` on free loopback ports, with its
/// data directory and log in `dir`.
pub fn start_headroom(
    dir: &Path,
    config: &str,
    policy: &str,
    token_text: &str,
) -> Result<HeadroomServer> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let config_path = dir.join("node.toml");
    std::fs::write(&config_path, config)
        .with_context(|| format!("writing {}", config_path.display()))?;
    let log_path = dir.join("server.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding this executable")?;
    let child = Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&config_path)
        .arg("--policy")
        .arg(policy)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .env("HEADROOM_TOKEN", token_text)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .context("starting headroom serve")?;
    let mut guard = ChildGuard::new(child, &format!("headroom-{policy}"), log_path);
    let stdout = guard
        .child
        .as_mut()
        .and_then(|c| c.stdout.take())
        .context("server stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent && line.starts_with("nbd://") {
                sent = tx.send(line).is_ok();
            }
        }
    });
    let line = match rx.recv_timeout(READY_TIMEOUT) {
        Ok(line) => line,
        Err(_) => {
            let status = guard.exited();
            bail!(
                "headroom serve (policy {policy}) did not become ready ({}); its log:\n{}",
                status.map_or("still running".to_string(), |s| s.to_string()),
                guard.log_tail()
            );
        }
    };
    // `nbd://ADDR  api http://ADDR`
    let mut parts = line.split_whitespace();
    let nbd = parts
        .next()
        .and_then(|s| s.strip_prefix("nbd://"))
        .context("server's ready line")?
        .to_string();
    let api_url = parts.nth(1).context("server's ready line")?.to_string();
    let api = api_client(&api_url, token_text)?;
    Ok(HeadroomServer {
        guard,
        nbd,
        api,
        api_url,
    })
}

/// A client of a Headroom API with this token.
pub fn api_client(url: &str, token_text: &str) -> Result<Api> {
    let token = ApiToken::new(token_text).map_err(|e| anyhow::anyhow!("API token: {e}"))?;
    Ok(Api::new(url, token::Found::Environment(token)))
}

/// Creates a volume with its QoS through the API.
pub fn create_volume(api: &Api, name: &str, size_bytes: u64, qos: &QosSpec) -> Result<()> {
    api.create(&CreateVolume {
        name: name.to_string(),
        size_bytes,
        qos: (!qos.is_empty()).then(|| qos.clone()),
        tenant: None,
        read_only: false,
        replicas: None,
    })
    .with_context(|| format!("creating volume {name}"))?;
    Ok(())
}

/// Per volume: `(reads, writes)` from `headroom_volume_ops_total` in `GET /metrics`.
pub fn volume_ops(
    api_url: &str,
    token_text: &str,
) -> Result<std::collections::HashMap<String, (u64, u64)>> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let body = agent
        .get(format!("{}/metrics", api_url.trim_end_matches('/')))
        .header("Authorization", format!("Bearer {token_text}"))
        .call()
        .context("GET /metrics")?
        .body_mut()
        .read_to_string()
        .context("reading /metrics")?;
    let mut out: std::collections::HashMap<String, (u64, u64)> = Default::default();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("headroom_volume_ops_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == name).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        let (Some(volume), Some(op)) = (label("volume"), label("op")) else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let entry = out.entry(volume).or_default();
        match op.as_str() {
            "read" => entry.0 += value as u64,
            "write" => entry.1 += value as u64,
            _ => {}
        }
    }
    Ok(out)
}
