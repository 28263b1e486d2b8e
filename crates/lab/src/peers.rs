//! A lab run, part three: the peers an operator would otherwise deploy, measured in
//! the same run with the same tenants as extra rows.
//!
//! * `qsd-static`: one qemu-storage-daemon serving every tenant's export, each behind its own
//!   throttle group capped at the tenant's baseline (`limits.iops-total`, `limits.bps-total`):
//!   what static provisioning gives.
//! * `qsd-burst`: the same with QEMU's burst settings up to the tenant's ceiling
//!   (`limits.*-total-max`, for the whole run: `*-max-length` = the scenario's duration).
//! * `nbdkit-rate`: one nbdkit (`memory` plugin, `rate` filter) per tenant, its bandwidth
//!   capped at the tenant's baseline bytes/s (`rate=`; the filter limits bits per second only,
//!   so IOPS limits are not expressible there; `burstiness` stays at its default 2 s).
//!
//! Why the caveat in every peer row: neither peer has an emulated device. They run at this
//! machine's RAM and CPU speed (qsd on raw images in /dev/shm, filled with random data because
//! qemu 10 lets reads of holes bypass the throttle; nbdkit in its own memory), so their rows
//! show what each throttle does to the tenants on a CPU-bound node, not the same device as
//! Headroom's rows. Every peer process is started on a free loopback port and stopped by PID
//! (SIGTERM, then SIGKILL) at the end of its row, also when the row fails.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use headroom_qos::VolumeQos;

use crate::Target;
use crate::drive::{Progress, drive, group_loads, volume_name};
use crate::error::RunError;
use crate::plan::{GroupPlan, Plan};
use crate::process::{ChildGuard, spawn};
use crate::report::{LabResult, result};
use crate::scratch::Scratch;

type Result<T> = std::result::Result<T, RunError>;

/// The peer rows `--policy` accepts.
pub const PEERS: [&str; 3] = ["qsd-static", "qsd-burst", "nbdkit-rate"];

/// How long a peer may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Whether `name` is a peer row rather than a policy of Headroom's.
pub fn is_peer(name: &str) -> bool {
    PEERS.contains(&name)
}

/// A free loopback port (bound, read, released: the peer binds it right after).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(RunError::io("finding a free port"))?;
    Ok(listener
        .local_addr()
        .map_err(RunError::io("finding a free port"))?
        .port())
}

/// Waits until `port` accepts a TCP connection, or the process exits, or the deadline.
fn wait_ready(guard: &mut ChildGuard, port: u16) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Some(status) = guard.exited() {
            return Err(RunError::PeerExited {
                name: guard.name.clone(),
                status,
                log: guard.log_tail(),
            });
        }
        if Instant::now() >= deadline {
            return Err(RunError::PeerNotListening {
                name: guard.name.clone(),
                port,
                timeout: READY_TIMEOUT,
                log: guard.log_tail(),
            });
        }
        // Polling a port with a deadline: the peers print nothing when ready.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A finite, positive limit, or none.
fn limit(v: u64) -> Option<u64> {
    (v > 0 && v != u64::MAX).then_some(v)
}

/// The throttle-group properties of a tenant for `qsd-static` or `qsd-burst`.
pub fn qsd_limits(q: &VolumeQos, burst: bool, burst_len_s: u64) -> Vec<String> {
    let mut out = Vec::new();
    let static_iops = limit(q.baseline.iops).or(limit(q.ceiling.iops));
    let static_bps = limit(q.baseline.bytes_per_s).or(limit(q.ceiling.bytes_per_s));
    if let Some(v) = static_iops {
        out.push(format!("limits.iops-total={v}"));
    }
    if let Some(v) = static_bps {
        out.push(format!("limits.bps-total={v}"));
    }
    if burst && !matches!(q.burst, headroom_qos::BurstMode::None) {
        if let (Some(base), Some(max)) = (static_iops, limit(q.ceiling.iops))
            && max > base
        {
            out.push(format!("limits.iops-total-max={max}"));
            out.push(format!("limits.iops-total-max-length={burst_len_s}"));
        }
        if let (Some(base), Some(max)) = (static_bps, limit(q.ceiling.bytes_per_s))
            && max > base
        {
            out.push(format!("limits.bps-total-max={max}"));
            out.push(format!("limits.bps-total-max-length={burst_len_s}"));
        }
    }
    out
}

/// A raw image of `bytes`, filled with pseudo-random data.
fn make_image(path: &Path, bytes: u64, seed: u64) -> Result<()> {
    let mut rng = crate::SplitMix64::new(seed);
    let chunk: Vec<u8> = (0..(1 << 20) / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path)
            .map_err(RunError::io(format!("creating {}", path.display())))?,
    );
    let mut left = bytes;
    let writing = || RunError::io(format!("writing {}", path.display()));
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        file.write_all(&chunk[..n]).map_err(writing())?;
        left -= n as u64;
    }
    file.flush().map_err(writing())?;
    Ok(())
}

/// One peer row: its servers started, the plan's load driven against them, stopped.
pub fn run_peer(plan: &Plan, policy: &str, seed: u64, progress: Progress) -> Result<LabResult> {
    match policy {
        "qsd-static" => run_qsd(plan, false, seed, progress),
        "qsd-burst" => run_qsd(plan, true, seed, progress),
        "nbdkit-rate" => run_nbdkit(plan, seed, progress),
        other => Err(RunError::UnknownPeer(other.to_string())),
    }
}

/// Export size for a peer: the part of the volume the load touches.
fn peer_bytes(g: &GroupPlan) -> u64 {
    g.region_bytes
}

fn run_qsd(plan: &Plan, burst: bool, seed: u64, progress: Progress) -> Result<LabResult> {
    let name = if burst { "qsd-burst" } else { "qsd-static" };
    let shm = Path::new("/dev/shm");
    let scratch = if shm.is_dir() {
        Scratch::under(shm, name)?
    } else {
        Scratch::new(name)?
    };
    let port = free_port()?;
    let burst_len = plan.duration.as_secs().max(1);
    let tenants: u32 = plan.groups.iter().map(|g| g.tenants).sum();
    // The NBD server first: qsd refuses an --export before it.
    let mut args = vec![
        "--nbd-server".to_string(),
        format!(
            "addr.type=inet,addr.host=127.0.0.1,addr.port={port},max-connections={}",
            tenants.max(1) + 4
        ),
    ];
    for (gi, g) in plan.groups.iter().enumerate() {
        let props = qsd_limits(&g.limits, burst, burst_len);
        for i in 0..g.tenants {
            let export = volume_name("lab-", &g.name, i);
            let id = format!("g{gi}t{i}");
            let image = scratch.0.join(format!("{id}.img"));
            make_image(&image, peer_bytes(g), seed ^ u64::from(i))?;
            let group = if props.is_empty() {
                format!("throttle-group,id=tg{id}")
            } else {
                format!("throttle-group,id=tg{id},{}", props.join(","))
            };
            args.extend([
                "--blockdev".to_string(),
                format!(
                    "driver=file,node-name=f{id},filename={},aio=threads",
                    image.display()
                ),
                "--object".to_string(),
                group,
                "--blockdev".to_string(),
                format!("driver=throttle,node-name=t{id},throttle-group=tg{id},file=f{id}"),
                "--export".to_string(),
                format!("type=nbd,id=e{id},node-name=t{id},name={export},writable=on"),
            ]);
        }
    }
    let mut guard = spawn(&scratch.0, name, "qemu-storage-daemon", &args)?;
    wait_ready(&mut guard, port)?;
    let loads = group_loads(plan, seed, |g, i| Target {
        addr: format!("127.0.0.1:{port}"),
        export: volume_name("lab-", g, i),
    });
    let run = drive(&loads, plan, progress).map_err(|e| RunError::WithLog {
        name: name.to_string(),
        log: guard.log_tail(),
        source: Box::new(e),
    })?;
    let pid = guard.pid();
    guard.stop();
    let mut row = result(
        name,
        plan,
        "qemu-storage-daemon (no emulated device: raw images on tmpfs at machine speed)",
        &run,
        None,
    );
    row.details.server_pid = Some(pid);
    Ok(row)
}

fn run_nbdkit(plan: &Plan, seed: u64, progress: Progress) -> Result<LabResult> {
    let scratch = Scratch::new("nbdkit-rate")?;
    let mut guards = Vec::new();
    let mut ports: Vec<Vec<u16>> = Vec::new();
    for g in &plan.groups {
        let mut group_ports = Vec::new();
        for i in 0..g.tenants {
            let port = free_port()?;
            let mut args = vec![
                "-f".to_string(),
                "-i".to_string(),
                "127.0.0.1".to_string(),
                "-p".to_string(),
                port.to_string(),
                "--filter=rate".to_string(),
                "memory".to_string(),
                peer_bytes(g).to_string(),
            ];
            if let Some(bps) =
                limit(g.limits.baseline.bytes_per_s).or(limit(g.limits.ceiling.bytes_per_s))
            {
                args.push(format!("rate={}", bps.saturating_mul(8)));
            }
            let name = format!("nbdkit-{}", volume_name("", &g.name, i));
            let mut guard = spawn(&scratch.0, &name, "nbdkit", &args)?;
            wait_ready(&mut guard, port)?;
            guards.push(guard);
            group_ports.push(port);
        }
        ports.push(group_ports);
    }
    let loads = group_loads(plan, seed, |g, i| {
        let gi = plan.groups.iter().position(|p| p.name == g).unwrap_or(0);
        Target {
            addr: format!("127.0.0.1:{}", ports[gi][i as usize]),
            export: volume_name("lab-", g, i),
        }
    });
    let run = drive(&loads, plan, progress)?;
    let first_pid = guards.first().map(ChildGuard::pid);
    for guard in &mut guards {
        guard.stop();
    }
    let mut row = result(
        "nbdkit-rate",
        plan,
        "nbdkit memory + rate filter, one per tenant (no emulated device; bandwidth limit only)",
        &run,
        None,
    );
    row.details.server_pid = first_pid;
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_qos::QosSpec;

    #[test]
    fn qsd_throttles_follow_baseline_and_ceiling() {
        let q = QosSpec {
            baseline_iops: Some(2000),
            baseline_mbps: Some(40),
            ceiling_iops: Some(20_000),
            ceiling_mbps: Some(400),
            burst: Some(headroom_qos::BurstKind::OnDemand),
            ..QosSpec::default()
        }
        .resolve(1 << 30)
        .expect("valid");
        assert_eq!(
            qsd_limits(&q, false, 10),
            ["limits.iops-total=2000", "limits.bps-total=40000000"]
        );
        assert_eq!(
            qsd_limits(&q, true, 10),
            [
                "limits.iops-total=2000",
                "limits.bps-total=40000000",
                "limits.iops-total-max=20000",
                "limits.iops-total-max-length=10",
                "limits.bps-total-max=400000000",
                "limits.bps-total-max-length=10"
            ]
        );
        assert!(qsd_limits(&VolumeQos::default(), true, 10).is_empty());
    }
}
