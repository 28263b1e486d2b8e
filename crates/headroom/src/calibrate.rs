//! `headroom calibrate`: measures what a request costs on this machine and writes it as a
//! configuration file `serve` loads (`[qos.capacity]` and `[qos.cost]` only).
//!
//! The node runs in this process with no scheduler (policy off) on the chosen backend, with a
//! scratch volume that is filled first (so reads read data, not holes) and deleted at the end.
//! fio drives it over NBD (`--ioengine=nbd`), random I/O at queue depth 32, one point per
//! (read | write, size). For each point:
//! - **CPU ns per request** = this process's CPU time (every thread: network, executor,
//!   store; `CLOCK_PROCESS_CPUTIME_ID`) over the point ÷ the requests fio completed. fio runs
//!   in its own process, so its CPU is not counted. A [`LinearCpu`] per op is fitted to the
//!   points by least squares on the relative error (small requests matter as much as big ones);
//! - **achieved IOPS** at that size: Libra's curve, written as a VOP curve
//!   (`qos.cost.device = { vop = ... }`): one VOP is the fastest request measured, the device
//!   capacity is that many thousand milli-VOPs per second.
//!
//! - **a device sync** (`cpu.sync`): 4 KiB random writes at queue depth 1, each followed by
//!   a FLUSH (`--fsync=1`), against the same writes without the FLUSH; the difference per
//!   write, less the cheapest request's CPU (what `cpu.other` charges the FLUSH itself), is
//!   what one sync costs this process: mostly kernel time in `fdatasync`. On the memory
//!   backend it is what a FLUSH costs there, nearly nothing.
//!
//! The CPU capacity written is the CPUs this process may use × 10⁹ ns/s: the costs are
//! whole-process CPU time, so all the cores are what they share.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Args;
use headroom_node::config::PolicyChoice;
use headroom_node::{Node, NodeConfig, StoreBackend};
use headroom_qos::NS_PER_S;
use headroom_qos::model::{LinearCpu, VopCurve};
use indicatif::{ProgressBar, ProgressStyle};

use crate::serve_config::{
    CALIBRATION_FILE, DEFAULT_DATA_DIR, DEFAULT_DEVICE_SIZE, DEFAULT_DEVICES,
};
use crate::size::{format_size, parse_size};

/// Name of the volume measured (deleted at the end; replaced if left over by a crash).
const SCRATCH_VOLUME: &str = "calibrate-scratch";
/// Largest scratch volume.
const MAX_SCRATCH_BYTES: u64 = 1 << 30;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Measure the file backend in this data directory (created if missing; no server may be
    /// running on it) [default: ./headroom-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Measure the memory backend with this pool capacity instead (e.g. 1GiB).
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Where to write the result [default: DATA_DIR/calibration.toml, which `serve` loads].
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Seconds fio runs each (op, size) point.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds_per_point: u64,
    /// Request sizes to measure, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4k,16k,64k,128k,1m",
        value_parser = parse_size
    )]
    sizes: Vec<u64>,
    /// Requests in flight (fio --iodepth).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    iodepth: u32,
    /// Print the measured points, the fitted model and the file written as JSON.
    #[arg(long)]
    json: bool,
}

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// One measured (op, size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Point {
    pub op: Op,
    pub size_bytes: u64,
    /// Requests fio completed.
    pub requests: u64,
    /// Requests per second fio achieved.
    pub iops: u64,
    /// Server CPU time per request.
    pub cpu_ns: u64,
}

/// The sync measurement: 4 KiB random writes at queue depth 1, with and without a FLUSH
/// after each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncPoint {
    /// Writes fio completed with a FLUSH after each.
    pub flushed_writes: u64,
    /// Server CPU time per write and its FLUSH.
    pub flushed_write_cpu_ns: u64,
    /// Server CPU time per write without a FLUSH (same size and depth).
    pub plain_write_cpu_ns: u64,
}

/// Everything measured, and how.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub points: Vec<Point>,
    pub sync: SyncPoint,
    /// What was measured (`memory backend (256MiB)`, `data directory /srv/h`).
    pub backend: String,
    pub fio_version: String,
    pub seconds_per_point: u64,
    pub iodepth: u32,
    /// CPUs this process may use.
    pub cpus: u64,
    pub unix_s: u64,
}

/// The model fitted to a measurement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    pub read: LinearCpu,
    pub write: LinearCpu,
    pub other: LinearCpu,
    /// One device sync (`cpu.sync`): measured, not per KiB.
    pub sync: LinearCpu,
    pub curve: VopCurve,
    pub cpu_ns_per_s: u64,
    pub device_units_per_s: u64,
}

pub fn run(args: CalibrateArgs) -> Result<()> {
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let max_request = u64::from(headroom_nbd::MAX_PAYLOAD_BYTES);
    if sizes.is_empty() {
        bail!("--sizes: give at least one size");
    }
    if let Some(&bad) = sizes.iter().find(|&&s| !(512..=max_request).contains(&s)) {
        bail!(
            "--sizes: {} is out of range: sizes must be between 512 and {}",
            format_size(bad),
            format_size(max_request)
        );
    }
    let fio_version = fio_version()?;
    crate::init_logging("warn", crate::LogFormat::Text);

    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| data_dir.join(CALIBRATION_FILE));
    let (backend, backend_text) = match args.memory {
        Some(capacity_bytes) => (
            StoreBackend::Memory { capacity_bytes },
            format!("memory backend ({})", format_size(capacity_bytes)),
        ),
        None => (
            StoreBackend::Files {
                data_dir: data_dir.clone(),
                device_count: DEFAULT_DEVICES,
                device_capacity_bytes: DEFAULT_DEVICE_SIZE,
                device_paths: Vec::new(),
            },
            format!("data directory {}", data_dir.display()),
        ),
    };
    let mut config = NodeConfig::new(backend);
    config.nbd_listen = Some(([127, 0, 0, 1], 0).into());
    config.api_listen = ([127, 0, 0, 1], 0).into();
    config.qos.policy = PolicyChoice::Off;

    let runtime = crate::runtime()?;
    let node = runtime.block_on(Node::start(config)).with_context(|| {
        format!("starting the node on the {backend_text} (is a server running on it?)")
    })?;
    let store = std::sync::Arc::clone(node.store());
    if store.volume_info(SCRATCH_VOLUME).is_ok() {
        store
            .delete_volume(SCRATCH_VOLUME)
            .context("deleting a scratch volume left by an earlier run")?;
    }
    let largest = sizes.last().copied().unwrap_or(4096);
    let volume_bytes = (store.pool_info().free_bytes / 2).min(MAX_SCRATCH_BYTES) & !((1 << 20) - 1);
    let needed = (largest * u64::from(args.iodepth)).max(16 << 20);
    let measured = if volume_bytes < needed {
        Err(anyhow::anyhow!(
            "the pool is too small: a {} scratch volume is needed, which takes a pool of at \
             least {}",
            format_size(needed),
            format_size(2 * needed)
        ))
    } else {
        store
            .create_volume(SCRATCH_VOLUME, volume_bytes)
            .context("creating the scratch volume")
            .and_then(|_| {
                let uri = format!(
                    "nbd://{}/{SCRATCH_VOLUME}",
                    node.nbd_addr.expect("calibrate listens on TCP")
                );
                measure(&uri, &sizes, args.seconds_per_point, args.iodepth)
            })
    };
    let _ = store.delete_volume(SCRATCH_VOLUME);
    drop(store);
    runtime
        .block_on(node.shutdown())
        .context("stopping the node")?;
    let (points, sync) = measured?;

    let measurement = Measurement {
        points,
        sync,
        backend: backend_text,
        fio_version,
        seconds_per_point: args.seconds_per_point,
        iodepth: args.iodepth,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        unix_s: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let fit = fit(&measurement);
    let text = render(&measurement, &fit);
    write_atomically(&out, &text)?;

    if args.json {
        return crate::output::print_json(&json_report(&measurement, &fit, &out));
    }
    let mut text = table(&measurement, &fit, crate::output::stdout_styled());
    text.push_str(&format!("\nwrote {}\n", out.display()));
    if args.out.is_none() {
        text.push_str(&format!(
            "`headroom serve --data-dir {}` loads it under --config and the flags\n",
            data_dir.display()
        ));
    } else {
        text.push_str(&format!(
            "use it with `headroom serve --config {}`, or copy it to DATA_DIR/{CALIBRATION_FILE}\n",
            out.display()
        ));
    }
    crate::output::emit(&text);
    Ok(())
}

/// `--json`: what was measured, the model fitted to it and where it was written.
fn json_report(m: &Measurement, fit: &Fit, out: &Path) -> serde_json::Value {
    let line =
        |l: &LinearCpu| serde_json::json!({ "base_ns": l.base_ns, "per_kib_ps": l.per_kib_ps });
    let points: Vec<serde_json::Value> = m
        .points
        .iter()
        .map(|p| {
            let model = match p.op {
                Op::Read => fit.read,
                Op::Write => fit.write,
            };
            serde_json::json!({
                "op": p.op.name(),
                "size_bytes": p.size_bytes,
                "requests": p.requests,
                "iops": p.iops,
                "cpu_ns": p.cpu_ns,
                "model_cpu_ns": model.cpu_ns(p.size_bytes),
            })
        })
        .collect();
    serde_json::json!({
        "file": out.display().to_string(),
        "backend": m.backend,
        "fio_version": m.fio_version,
        "seconds_per_point": m.seconds_per_point,
        "iodepth": m.iodepth,
        "cpus": m.cpus,
        "unix_s": m.unix_s,
        "points": points,
        "cpu": {
            "read": line(&fit.read),
            "write": line(&fit.write),
            "other": line(&fit.other),
            "sync": line(&fit.sync),
        },
        "sync_measurement": {
            "flushed_writes": m.sync.flushed_writes,
            "flushed_write_cpu_ns": m.sync.flushed_write_cpu_ns,
            "plain_write_cpu_ns": m.sync.plain_write_cpu_ns,
        },
        "capacity": {
            "cpu_ns_per_s": fit.cpu_ns_per_s,
            "device_units_per_s": fit.device_units_per_s,
        },
        "vop": {
            "max_iops": fit.curve.max_iops,
            "read": fit.curve.read,
            "write": fit.curve.write,
        },
    })
}

fn fio_version() -> Result<String> {
    match Command::new("fio").arg("--version").output() {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
        Ok(out) => bail!(
            "`fio --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => bail!(
            "fio is not installed: `headroom calibrate` drives the server with fio's nbd engine \
             (install it with `apt-get install fio`)"
        ),
        Err(err) => Err(err).context("running fio"),
    }
}

/// This process's CPU time (all threads), ns.
fn process_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(NS_PER_S).saturating_add(nanos)
}

fn measure(
    uri: &str,
    sizes: &[u64],
    seconds: u64,
    iodepth: u32,
) -> Result<(Vec<Point>, SyncPoint)> {
    let total = 3 + 2 * sizes.len() as u64;
    let bar = ProgressBar::new(total);
    let style =
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:24} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(100));
    bar.set_message("filling the scratch volume");
    let result = (|| {
        fio(uri, "write", 1 << 20, 8, None, false).context("filling the scratch volume")?;
        bar.inc(1);
        let mut points = Vec::new();
        for op in [Op::Read, Op::Write] {
            for &size in sizes {
                bar.set_message(format!(
                    "random {} {} at QD{iodepth} for {seconds} s",
                    op.name(),
                    format_size(size)
                ));
                let rw = match op {
                    Op::Read => "randread",
                    Op::Write => "randwrite",
                };
                let before = process_cpu_ns();
                let report = fio(uri, rw, size, iodepth, Some(seconds), false)
                    .with_context(|| format!("measuring {rw} {}", format_size(size)))?;
                let cpu = process_cpu_ns().saturating_sub(before);
                let (requests, iops) = match op {
                    Op::Read => report.read,
                    Op::Write => report.write,
                };
                if requests == 0 {
                    bail!("fio completed no {rw} of {}", format_size(size));
                }
                points.push(Point {
                    op,
                    size_bytes: size,
                    requests,
                    iops: iops.max(1),
                    cpu_ns: (cpu / requests).max(1),
                });
                bar.inc(1);
            }
        }
        // The sync: the same writes at queue depth 1 without and with a FLUSH after each.
        let mut per_write = [0; 2];
        let mut flushed_writes = 0;
        for (slot, flush) in [false, true].into_iter().enumerate() {
            bar.set_message(format!(
                "random write 4KiB at QD1{} for {seconds} s",
                if flush { ", a FLUSH after each" } else { "" }
            ));
            let before = process_cpu_ns();
            let report =
                fio(uri, "randwrite", 4096, 1, Some(seconds), flush).context("measuring a sync")?;
            let cpu = process_cpu_ns().saturating_sub(before);
            let (requests, _) = report.write;
            if requests == 0 {
                bail!("fio completed no write at QD1 (flush: {flush})");
            }
            per_write[slot] = (cpu / requests).max(1);
            flushed_writes = requests;
            bar.inc(1);
        }
        let sync = SyncPoint {
            flushed_writes,
            flushed_write_cpu_ns: per_write[1],
            plain_write_cpu_ns: per_write[0],
        };
        Ok((points, sync))
    })();
    bar.finish_and_clear();
    result
}

/// Requests completed and IOPS, per direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct FioReport {
    read: (u64, u64),
    write: (u64, u64),
}

/// Runs fio on `uri`; `fsync`: a FLUSH after every write (`--fsync=1`).
fn fio(
    uri: &str,
    rw: &str,
    bs: u64,
    iodepth: u32,
    seconds: Option<u64>,
    fsync: bool,
) -> Result<FioReport> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=calibrate",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        &format!("--rw={rw}"),
        &format!("--bs={bs}"),
        &format!("--iodepth={iodepth}"),
        "--output-format=json",
        "--randrepeat=0",
        "--norandommap",
    ]);
    if let Some(seconds) = seconds {
        cmd.args(["--time_based", &format!("--runtime={seconds}s")]);
    }
    if fsync {
        cmd.arg("--fsync=1");
    }
    let out = cmd.output().context("running fio")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            stdout.trim()
        );
    }
    parse_fio(&stdout)
}

/// Parses `fio --output-format=json` (whatever fio printed before the JSON is skipped).
fn parse_fio(stdout: &str) -> Result<FioReport> {
    let start = stdout
        .find('{')
        .with_context(|| format!("fio printed no JSON: {stdout}"))?;
    let json: serde_json::Value =
        serde_json::from_str(&stdout[start..]).context("parsing fio's JSON output")?;
    let job = &json["jobs"][0];
    let error = job["error"].as_u64().unwrap_or(0);
    if error != 0 {
        bail!("fio reported error {error}");
    }
    let dir = |name: &str| {
        let d = &job[name];
        let requests = d["total_ios"].as_u64().unwrap_or(0);
        let iops = d["iops"].as_f64().unwrap_or(0.0).round() as u64;
        (requests, iops)
    };
    Ok(FioReport {
        read: dir("read"),
        write: dir("write"),
    })
}

/// Fits `cpu = base + slope × size` to `(size, cpu_ns)` points, minimising the relative error
/// (weights 1/cpu²), with base and slope kept ≥ 0.
pub fn fit_line(points: &[(u64, u64)]) -> LinearCpu {
    let (mut w, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in points {
        let (x, y) = (x as f64, (y.max(1)) as f64);
        let wi = 1.0 / (y * y);
        w += wi;
        sx += wi * x;
        sy += wi * y;
        sxx += wi * x * x;
        sxy += wi * x * y;
    }
    if w == 0.0 {
        return LinearCpu {
            base_ns: 0,
            per_kib_ps: 0,
        };
    }
    let det = w * sxx - sx * sx;
    let (mut base, mut slope) = if det.abs() <= f64::EPSILON * w * sxx {
        (sy / w, 0.0)
    } else {
        let slope = (w * sxy - sx * sy) / det;
        ((sy - slope * sx) / w, slope)
    };
    if slope < 0.0 {
        slope = 0.0;
        base = sy / w;
    }
    if base < 0.0 {
        base = 0.0;
        slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    }
    LinearCpu {
        base_ns: base.round() as u64,
        per_kib_ps: (slope * 1024.0 * 1000.0).round() as u64,
    }
}

pub fn fit(m: &Measurement) -> Fit {
    let of = |op: Op| -> Vec<(u64, u64)> {
        m.points
            .iter()
            .filter(|p| p.op == op)
            .map(|p| (p.size_bytes, p.cpu_ns))
            .collect()
    };
    let iops_of = |op: Op| -> Vec<(u64, u64)> {
        m.points
            .iter()
            .filter(|p| p.op == op)
            .map(|p| (p.size_bytes, p.iops))
            .collect()
    };
    let read = fit_line(&of(Op::Read));
    let write = fit_line(&of(Op::Write));
    // Flush, trim and write-zeroes carry no payload: charge them the cheapest request
    // measured, and a write-zeroes the default per KiB it zeroes (not measured here).
    let cheapest = m.points.iter().map(|p| p.cpu_ns).min().unwrap_or(0);
    let other = LinearCpu {
        base_ns: cheapest,
        per_kib_ps: headroom_qos::model::DEFAULT_ZERO_CPU_PER_KIB_PS,
    };
    // What the FLUSH added to each write, less what `other` charges the FLUSH request.
    let sync = LinearCpu {
        base_ns: sync_cpu_ns(&m.sync, cheapest),
        per_kib_ps: 0,
    };
    let read_iops = iops_of(Op::Read);
    let write_iops = iops_of(Op::Write);
    let max_iops = read_iops
        .iter()
        .chain(&write_iops)
        .map(|p| p.1)
        .max()
        .unwrap_or(1)
        .max(1);
    Fit {
        read,
        write,
        other,
        sync,
        curve: VopCurve {
            max_iops,
            read: read_iops,
            write: write_iops,
        },
        cpu_ns_per_s: m.cpus.max(1).saturating_mul(NS_PER_S),
        device_units_per_s: max_iops.saturating_mul(1000),
    }
}

/// One sync's CPU: what a FLUSH after each write added to it, less `flush_request_ns` (the
/// FLUSH request's own charge), at least 1 ns.
pub fn sync_cpu_ns(sync: &SyncPoint, flush_request_ns: u64) -> u64 {
    sync.flushed_write_cpu_ns
        .saturating_sub(sync.plain_write_cpu_ns)
        .saturating_sub(flush_request_ns)
        .max(1)
}

/// `1234567` → `1_234_567` (TOML integer).
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('_');
        }
        out.push(c);
    }
    out
}

/// `YYYY-MM-DD HH:MM:SS` UTC.
pub fn utc(unix_s: u64) -> String {
    let days = (unix_s / 86_400) as i64;
    let rem = unix_s % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The points and the model's cost at each; `styled`: bold header (a terminal, not the file).
fn table(m: &Measurement, fit: &Fit, styled: bool) -> String {
    use crate::output::{Align, Table};
    let mut table = Table::new(&[
        ("OP", Align::Left),
        ("SIZE", Align::Right),
        ("IOPS", Align::Right),
        ("CPU NS/REQ", Align::Right),
        ("MODEL NS", Align::Right),
    ]);
    for p in &m.points {
        let line = match p.op {
            Op::Read => fit.read,
            Op::Write => fit.write,
        };
        table.row(vec![
            p.op.name().to_string(),
            format_size(p.size_bytes),
            crate::output::grouped(p.iops),
            crate::output::grouped(p.cpu_ns),
            crate::output::grouped(line.cpu_ns(p.size_bytes)),
        ]);
    }
    table.render(styled)
}

fn line_toml(l: &LinearCpu) -> String {
    format!(
        "{{ base_ns = {}, per_kib_ps = {} }}",
        grouped(l.base_ns),
        grouped(l.per_kib_ps)
    )
}

fn curve_toml(points: &[(u64, u64)]) -> String {
    let items: Vec<String> = points
        .iter()
        .map(|&(size, iops)| format!("[\"{}\", {}]", format_size(size), grouped(iops)))
        .collect();
    format!("[{}]", items.join(", "))
}

/// The configuration file: a comment header saying when and how, then `[qos.capacity]` and
/// `[qos.cost]`.
pub fn render(m: &Measurement, fit: &Fit) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "# Headroom calibration, written by `headroom calibrate` on {} UTC.\n\
         # Backend: the {}.\n\
         # How: no scheduler (policy off), {} over NBD on loopback (--ioengine=nbd),\n\
         # random I/O at queue depth {}, {} s per point, {} CPU(s), fio on the same machine.\n\
         # CPU = this server process's CPU time per request (all its threads; fio's own CPU\n\
         # is not counted). IOPS = what fio achieved at that size (Libra's VOP curve).\n#\n",
        utc(m.unix_s),
        m.backend,
        m.fio_version,
        m.iodepth,
        m.seconds_per_point,
        m.cpus
    ));
    for row in table(m, fit, false).lines() {
        out.push_str(&format!("#   {row}\n").replace("#   \n", "#\n"));
    }
    out.push_str(
        "#\n# `headroom serve` loads DATA_DIR/calibration.toml under --config and the flags\n\
         # (docs/operations.md, \"Calibration\"). Run `headroom calibrate` again after changing\n\
         # the machine, the backend or the build.\n\n",
    );
    out.push_str(&format!(
        "[qos.capacity]\n\
         # CPU-ns per second: {} CPU(s) x 10^9 (the costs below are whole-process CPU time).\n\
         cpu_ns_per_s = {}\n\
         # Milli-VOPs per second: max_iops x 1000 (one VOP = the fastest request measured).\n\
         device_units_per_s = {}\n\n",
        m.cpus,
        grouped(fit.cpu_ns_per_s),
        grouped(fit.device_units_per_s)
    ));
    out.push_str(&format!(
        "[qos.cost]\n\
         # CPU ns per request = base_ns + KiB x per_kib_ps / 1000, fitted to the points above.\n\
         cpu.read = {}\n\
         cpu.write = {}\n\
         # Flush, trim, write-zeroes: the cheapest request measured.\n\
         cpu.other = {}\n\
         # One device sync (a FUA write's, each device's in a FLUSH): 4 KiB writes at QD1\n\
         # cost {} ns with a FLUSH after each, {} ns without; less cpu.other's base.\n\
         cpu.sync = {}\n\n",
        line_toml(&fit.read),
        line_toml(&fit.write),
        line_toml(&fit.other),
        grouped(m.sync.flushed_write_cpu_ns),
        grouped(m.sync.plain_write_cpu_ns),
        line_toml(&fit.sync)
    ));
    out.push_str(&format!(
        "# Achieved IOPS per request size: [size, IOPS].\n\
         [qos.cost.device.vop]\n\
         max_iops = {}\n\
         read = {}\n\
         write = {}\n",
        grouped(fit.curve.max_iops),
        curve_toml(&fit.curve.read),
        curve_toml(&fit.curve.write)
    ));
    out
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::serve_config::{ConfigFile, resolve};
    use headroom_qos::model::DeviceModel;

    fn sample() -> Measurement {
        let point = |op, size_bytes, iops, cpu_ns| Point {
            op,
            size_bytes,
            requests: iops * 2,
            iops,
            cpu_ns,
        };
        Measurement {
            points: vec![
                point(Op::Read, 4096, 60_000, 12_000),
                point(Op::Read, 65_536, 20_000, 30_000),
                point(Op::Read, 1 << 20, 1_500, 300_000),
                point(Op::Write, 4096, 50_000, 14_000),
                point(Op::Write, 65_536, 15_000, 40_000),
                point(Op::Write, 1 << 20, 1_000, 420_000),
            ],
            backend: "memory backend (256MiB)".into(),
            fio_version: "fio-3.33".into(),
            sync: SyncPoint {
                flushed_writes: 2_000,
                flushed_write_cpu_ns: 760_000,
                plain_write_cpu_ns: 40_000,
            },
            seconds_per_point: 2,
            iodepth: 32,
            cpus: 2,
            unix_s: 1_795_484_638,
        }
    }

    #[test]
    fn line_fit_goes_through_exact_points_and_stays_non_negative() {
        let exact = LinearCpu {
            base_ns: 5_000,
            per_kib_ps: 250_000,
        };
        let points: Vec<(u64, u64)> = [4096, 65_536, 1 << 20]
            .iter()
            .map(|&s| (s, exact.cpu_ns(s)))
            .collect();
        let got = fit_line(&points);
        assert!(got.base_ns.abs_diff(5_000) <= 2, "{got:?}");
        assert!(got.per_kib_ps.abs_diff(250_000) <= 100, "{got:?}");
        // Falling costs (noise): a flat line at the mean, never a negative slope.
        let flat = fit_line(&[(4096, 10_000), (65_536, 9_000)]);
        assert_eq!(flat.per_kib_ps, 0);
        assert!((9_000..=10_000).contains(&flat.base_ns), "{flat:?}");
        // A line through the origin is not pushed below it.
        let origin = fit_line(&[(4096, 100), (1 << 20, 1_000_000)]);
        assert!(
            origin.per_kib_ps > 0 && origin.cpu_ns(4096) > 0,
            "{origin:?}"
        );
        // One point: its cost, flat.
        let one = fit_line(&[(4096, 7_000)]);
        assert_eq!(one.cpu_ns(4096), 7_000);
        assert_eq!(fit_line(&[]).cpu_ns(4096), 0);
    }

    #[test]
    fn the_written_file_is_a_valid_configuration() {
        let m = sample();
        let f = fit(&m);
        let text = render(&m, &f);
        assert!(text.starts_with("# Headroom calibration"), "{text}");
        assert!(text.contains("2026-11-24 01:43:58 UTC"), "{text}");
        let layer = ConfigFile::parse(&text, Path::new(CALIBRATION_FILE)).unwrap();
        let c = resolve(&layer).unwrap();
        assert_eq!(c.qos.capacity.per_second.cpu_ns, 2 * NS_PER_S);
        assert_eq!(c.qos.capacity.per_second.device_units, 60_000_000);
        assert_eq!(c.qos.capacity.per_second.ingress_bytes, u64::MAX);
        assert_eq!(c.qos.cost_model.cpu.read, f.read);
        assert_eq!(c.qos.cost_model.cpu.write, f.write);
        assert_eq!(c.qos.cost_model.cpu.other.base_ns, 12_000);
        // The sync: 760 us with a FLUSH after each write, 40 us without, less the 12 us of the
        // FLUSH request itself.
        assert_eq!(f.sync.base_ns, 708_000);
        assert_eq!(c.qos.cost_model.cpu.sync, f.sync);
        assert_eq!(
            sync_cpu_ns(
                &SyncPoint {
                    flushed_writes: 1,
                    flushed_write_cpu_ns: 10,
                    plain_write_cpu_ns: 20,
                },
                5
            ),
            1,
            "a FLUSH that cost nothing measurable is a sync of 1 ns, never below"
        );
        let DeviceModel::Vop(curve) = &c.qos.cost_model.device else {
            panic!("not a VOP curve");
        };
        assert_eq!(curve, &f.curve);
        assert_eq!(
            curve.cost_milli_vops(headroom_qos::OpKind::Read, 4096),
            1_000
        );
        assert_eq!(
            curve.cost_milli_vops(headroom_qos::OpKind::Read, 65_536),
            3_000
        );
        // The fit follows the points within a few per cent.
        for p in &m.points {
            let line = if p.op == Op::Read { f.read } else { f.write };
            let model = line.cpu_ns(p.size_bytes);
            assert!(
                model.abs_diff(p.cpu_ns) * 100 <= p.cpu_ns * 25,
                "{p:?}: {model}"
            );
        }
    }

    #[test]
    fn fio_json_after_its_chatter() {
        let out = "fio: connected to NBD server\n{\n\"jobs\": [{\"error\": 0, \"read\": {\"total_ios\": 89576, \"iops\": 89486.51}, \"write\": {\"total_ios\": 0, \"iops\": 0.0}}]}\n";
        assert_eq!(
            parse_fio(out).unwrap(),
            FioReport {
                read: (89_576, 89_487),
                write: (0, 0)
            }
        );
        assert!(parse_fio("no json").is_err());
        assert!(parse_fio("{\"jobs\": [{\"error\": 5}]}").is_err());
    }

    #[test]
    fn helpers() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1_000), "1_000");
        assert_eq!(grouped(2_000_000_000), "2_000_000_000");
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_795_484_638), "2026-11-24 01:43:58");
    }
}
