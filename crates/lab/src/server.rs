//! A lab run, part two: the Headroom rows. For each policy the lab starts its own Headroom
//! server (`headroom serve`, one process per policy so each policy starts from the same empty
//! state) with the plan's configuration on free loopback ports, creates the scenario's volumes
//! through the API, drives them, checks the server's `/metrics` counters against the
//! generator's and stops the server by PID, also when the row fails (the guard's `Drop`). With
//! a target it runs against a server already running (its own policy) instead, and deletes
//! the volumes it created.
//!
//! Why the server is a process and not a node in this one: the generator's CPU is measured
//! per process, and a row must not share its runtime, allocator or signals with the load.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::api::{Connector, ServerApi};
use crate::drive::{Progress, drive, group_loads, volume_name};
use crate::error::RunError;
use crate::plan::{Plan, server_policy};
use crate::process::ChildGuard;
use crate::report::{LabResult, result};
use crate::scratch::Scratch;
use crate::{RunOutcome, Target};

/// How long a server may take to print its addresses.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A Headroom server started by the lab (or, with a detached guard, one already running).
pub struct HeadroomServer {
    pub guard: ChildGuard,
    /// Its NBD address.
    pub nbd: String,
    pub api: Box<dyn ServerApi>,
}

impl std::fmt::Debug for HeadroomServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadroomServer")
            .field("guard", &self.guard)
            .field("nbd", &self.nbd)
            .finish_non_exhaustive()
    }
}

/// Starts `EXE serve --config CONFIG --policy POLICY` on free loopback ports, with its data
/// directory and log in `dir`; `exe` is the `headroom` binary.
pub fn start_headroom(
    exe: &Path,
    dir: &Path,
    config: &str,
    policy: &str,
    token_text: &str,
    connector: &dyn Connector,
) -> Result<HeadroomServer, RunError> {
    std::fs::create_dir_all(dir).map_err(RunError::io(format!("creating {}", dir.display())))?;
    let config_path = dir.join("node.toml");
    std::fs::write(&config_path, config)
        .map_err(RunError::io(format!("writing {}", config_path.display())))?;
    let log_path = dir.join("server.log");
    let log = std::fs::File::create(&log_path)
        .map_err(RunError::io(format!("creating {}", log_path.display())))?;
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
        .map_err(RunError::io("starting headroom serve"))?;
    let mut guard = ChildGuard::new(child, &format!("headroom-{policy}"), log_path);
    let stdout = guard
        .child
        .as_mut()
        .and_then(|c| c.stdout.take())
        .ok_or(RunError::ReadyLine("server stdout"))?;
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
            return Err(RunError::NotReady {
                policy: policy.to_string(),
                status: status.map_or("still running".to_string(), |s| s.to_string()),
                log: guard.log_tail(),
            });
        }
    };
    // `nbd://ADDR  api http://ADDR`
    let mut parts = line.split_whitespace();
    let nbd = parts
        .next()
        .and_then(|s| s.strip_prefix("nbd://"))
        .ok_or(RunError::ReadyLine("server's ready line"))?
        .to_string();
    let api_url = parts
        .nth(1)
        .ok_or(RunError::ReadyLine("server's ready line"))?;
    let api = connector
        .connect(api_url, token_text)
        .map_err(RunError::Api)?;
    Ok(HeadroomServer { guard, nbd, api })
}

/// Creates a volume with its QoS through the API.
fn create_volume(
    api: &dyn ServerApi,
    name: &str,
    size_bytes: u64,
    qos: &headroom_qos::QosSpec,
) -> Result<(), RunError> {
    api.create_volume(name, size_bytes, qos)
        .map_err(|source| RunError::ApiCall {
            what: format!("creating volume {name}"),
            source,
        })
}

/// Per volume: `(reads, writes)` from `headroom_volume_ops_total` in the Prometheus text of
/// `GET /metrics`.
pub fn volume_ops(metrics: &str) -> HashMap<String, (u64, u64)> {
    let mut out: HashMap<String, (u64, u64)> = HashMap::new();
    // A line the parser does not understand is skipped: the counts are of the lines it does.
    for sample in crate::openmetrics::samples(metrics).filter_map(Result::ok) {
        if sample.name != "headroom_volume_ops_total" {
            continue;
        }
        let (Some(volume), Some(op)) = (sample.labels.get("volume"), sample.labels.get("op"))
        else {
            continue;
        };
        let entry = out.entry(volume.clone()).or_default();
        match op.as_str() {
            "read" => entry.0 += sample.value as u64,
            "write" => entry.1 += sample.value as u64,
            _ => {}
        }
    }
    out
}

/// One Headroom row: a server of its own for `policy`, measured, stopped.
pub fn run_headroom(
    exe: &Path,
    connector: &dyn Connector,
    plan: &Plan,
    policy: &str,
    seed: u64,
    progress: Progress,
) -> Result<LabResult, RunError> {
    let server_policy = server_policy(policy).ok_or_else(|| RunError::UnknownPolicy {
        policy: policy.to_string(),
        peers: crate::peers::PEERS.join(", "),
    })?;
    let scratch = Scratch::new(&server_policy)?;
    let token = connector.new_token().map_err(RunError::Api)?;
    let mut server = start_headroom(
        exe,
        &scratch.0,
        &plan.server_config,
        &server_policy,
        &token,
        connector,
    )?;
    let outcome = measure(&server, plan, seed, "lab-", progress);
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            return Err(RunError::WithLog {
                name: "server".into(),
                log: server.guard.log_tail(),
                source: Box::new(e),
            });
        }
    };
    let pid = server.guard.pid();
    let status = server.guard.stop();
    if !status.is_some_and(|s| s.success()) {
        eprintln!(
            "lab: warning: {} (PID {pid}) exited with {status:?}; log tail:\n{}",
            server.guard.name,
            server.guard.log_tail()
        );
    }
    let (run, server_counts) = outcome;
    let mut row = result(policy, plan, "headroom", &run, Some(&server_counts));
    row.details.server_pid = Some(pid);
    Ok(row)
}

/// Creates the volumes, runs the load, reads the server's counters.
fn measure(
    server: &HeadroomServer,
    plan: &Plan,
    seed: u64,
    prefix: &str,
    progress: Progress,
) -> Result<(RunOutcome, Vec<(u64, u64)>), RunError> {
    for g in &plan.groups {
        for i in 0..g.tenants {
            create_volume(
                server.api.as_ref(),
                &volume_name(prefix, &g.name, i),
                g.volume_bytes,
                &g.qos,
            )?;
        }
    }
    let loads = group_loads(plan, seed, |g, i| Target {
        addr: server.nbd.clone(),
        export: volume_name(prefix, g, i),
    });
    let run = drive(&loads, plan, progress)?;
    let ops = volume_ops(&server.api.metrics().map_err(RunError::Api)?);
    let counts = plan
        .groups
        .iter()
        .map(|g| {
            (0..g.tenants)
                .filter_map(|i| ops.get(&volume_name(prefix, &g.name, i)))
                .fold((0, 0), |(r, w), (a, b)| (r + a, w + b))
        })
        .collect();
    Ok((run, counts))
}

/// One run against an already running server. `requested`: the `--policy` values given (none:
/// the target's own policy is run, whatever the scenario lists; given: it must be the target's).
pub fn run_target(
    connector: &dyn Connector,
    plan: &Plan,
    url: &str,
    token: Option<&str>,
    requested: &[String],
    seed: u64,
    progress: Progress,
) -> Result<LabResult, RunError> {
    let token = token.ok_or(RunError::TargetToken)?;
    let api = connector.connect(url, token).map_err(RunError::Api)?;
    let node = api.node().map_err(RunError::Api)?;
    let nbd = node.nbd_listen.ok_or(RunError::TargetNoNbd)?;
    let policy = node.policy.unwrap_or_else(|| "unknown".to_string());
    let asked: Vec<String> = requested.iter().filter_map(|p| server_policy(p)).collect();
    if !asked.is_empty() && (asked.len() > 1 || asked[0] != policy) {
        return Err(RunError::TargetPolicy {
            url: url.to_string(),
            policy,
            requested: requested.join(", --policy "),
        });
    }

    let server = HeadroomServer {
        guard: ChildGuard::detached(),
        nbd,
        api,
    };
    let prefix = format!("lab{}-", std::process::id());
    let outcome = measure(&server, plan, seed, &prefix, progress);
    for g in &plan.groups {
        for i in 0..g.tenants {
            let _ = server.api.delete_volume(&volume_name(&prefix, &g.name, i));
        }
    }
    let (run, counts) = outcome?;
    Ok(result(
        &policy,
        plan,
        "headroom (--target)",
        &run,
        Some(&counts),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ops_sums_reads_and_writes_per_volume() {
        let text = "# HELP headroom_volume_ops_total ...\n\
                    headroom_volume_ops_total{volume=\"lab-a-0\",op=\"read\"} 10\n\
                    headroom_volume_ops_total{volume=\"lab-a-0\",op=\"write\"} 4\n\
                    headroom_volume_ops_total{volume=\"lab-a-1\",op=\"read\"} 2.0\n\
                    headroom_volume_ops_total{volume=\"lab-a-1\",op=\"flush\"} 7\n\
                    headroom_volume_bytes_total{volume=\"lab-a-0\",op=\"read\"} 40960\n";
        let ops = volume_ops(text);
        assert_eq!(ops.get("lab-a-0"), Some(&(10, 4)));
        assert_eq!(ops.get("lab-a-1"), Some(&(2, 0)));
        assert_eq!(ops.len(), 2);
    }
}
