//! `headroom`: the one binary. Serves volumes over NBD (`serve`, `demo`), manages them through
//! the node's HTTP API (`volume ...`), previews QoS classes (`qos preview`), runs the
//! simulator (`sim run`) and measures the machine for the scheduler (`calibrate`).

mod arbitration_cmd;
mod calibrate;
mod check_cmd;
mod client;
#[cfg(test)]
mod config_docs;
mod device_cmd;
mod lab_cmd;
mod output;
mod pool_cmd;
mod qos_cmd;
mod rebuild_cmd;
mod scrub_cmd;
mod sd_notify;
mod serve_config;
mod sim_cmd;
mod size;
mod tenant_cmd;
mod token;
mod token_cmd;
mod top;
mod volume_cmd;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use headroom_node::config::PolicyChoice;
use headroom_node::{Node, StoreBackend};

use crate::size::{format_size, parse_size};

#[derive(Parser, Debug)]
#[command(
    name = "headroom",
    version,
    about = "Multi-tenant, burst-aware NBD block storage",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the server: NBD exports (one per volume) and the management API.
    Serve(ServeArgs),
    /// Run the server on a default data directory with a sample volume, and print how to use it.
    Demo(DemoArgs),
    /// Show the pool: capacity, allocation and each device, from a running server's API.
    #[command(after_help = EXIT_CODES)]
    Pool(pool_cmd::PoolArgs),
    /// Cross-node arbitration of a shared RADOS pool: epoch, arbiter, this node's share and
    /// every node's, from a running server's API.
    #[command(after_help = EXIT_CODES)]
    Arbitration(arbitration_cmd::ArbitrationArgs),
    /// The pool's devices and what each is doing now (telemetry), from a running server's API.
    #[command(subcommand, after_help = EXIT_CODES)]
    Device(device_cmd::DeviceCommand),
    /// Manage volumes through a running server's API.
    #[command(subcommand, after_help = EXIT_CODES)]
    Volume(volume_cmd::VolumeCommand),
    /// The rebuild of lost copies after a device failure: progress, and its rate (live).
    #[command(subcommand, after_help = EXIT_CODES)]
    Rebuild(rebuild_cmd::RebuildCommand),
    /// The background scrub that verifies every allocated block: progress, what it found,
    /// its rate (live), and a pass on demand.
    #[command(subcommand, after_help = EXIT_CODES)]
    Scrub(scrub_cmd::ScrubCommand),
    /// Manage tenants (the owners volumes name) through a running server's API.
    #[command(subcommand)]
    Tenant(tenant_cmd::TenantCommand),
    /// Scoped API tokens (admin, read): create, list, revoke, through a running server's API.
    #[command(subcommand, after_help = EXIT_CODES)]
    Token(token_cmd::TokenCommand),
    /// Quality-of-service tools.
    #[command(subcommand)]
    Qos(qos_cmd::QosCommand),
    /// The discrete-event simulator.
    #[command(subcommand)]
    Sim(sim_cmd::SimCommand),
    /// The lab: a scenario of `sim run` on real I/O, against servers it starts itself.
    #[command(subcommand)]
    Lab(lab_cmd::LabCommand),
    /// Measure this machine's CPU cost per request and the backend's IOPS per request size,
    /// and write them as a configuration file `serve` loads.
    Calibrate(calibrate::CalibrateArgs),
    /// Live per-volume view of a running server (IOPS, MB/s, latency, credits, bursting).
    Top(top::TopArgs),
    /// Verify a stopped node's metadata (both copies, every row, every device file) and,
    /// with --repair, restore a damaged meta.redb from its copy. Exit 0 clean, 1 problems
    /// found, 2 cannot run (the server is running, or no metadata there).
    Check(check_cmd::CheckArgs),
}

/// Flags of `serve` and `demo`. Every one is optional: a flag given here overrides the
/// `--config` file, which overrides `DATA_DIR/calibration.toml`, which overrides the built-in
/// defaults (shown in brackets; see serve_config.rs).
#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Read settings from this TOML file (docs/operations.md, "Configuration file").
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Scheduling policy: off (unscheduled), wild, base, credit, burst, mclock or drr-vop
    /// [default: burst].
    #[arg(long, value_parser = parse_policy)]
    policy: Option<PolicyChoice>,
    /// Directory for device files and metadata (created if missing) [default: ./headroom-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// NBD listen address [default: 127.0.0.1:10809].
    #[arg(long)]
    nbd_listen: Option<SocketAddr>,
    /// Management API listen address [default: 127.0.0.1:10810].
    #[arg(long)]
    api_listen: Option<SocketAddr>,
    /// Keep everything in RAM with this pool capacity (e.g. 4GiB) instead of the data directory.
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Number of device files in a new data directory [default: 2].
    #[arg(long)]
    devices: Option<u32>,
    /// Capacity of each device file in a new data directory (sparse), or with --rados-pool
    /// the address space extents are allocated from [default: 64GiB].
    #[arg(long, value_parser = parse_size)]
    device_size: Option<u64>,
    /// Use this existing block device or file as a pool device (repeatable; replaces the
    /// created device files).
    #[arg(long = "device")]
    device_paths: Vec<PathBuf>,
    /// Keep the extents in a Ceph RADOS pool: the cluster's ceph.conf (with --rados-pool;
    /// needs a build with --features rados).
    #[arg(long, value_name = "FILE")]
    rados_conf: Option<PathBuf>,
    /// The RADOS pool (existing) holding the extents (with --rados-conf).
    #[arg(long, value_name = "POOL")]
    rados_pool: Option<String>,
    /// Connect to Ceph as this cephx user, without `client.` (its keyring named by the
    /// ceph.conf; e.g. headroom for client.headroom) [default: admin].
    #[arg(long, value_name = "ID")]
    rados_id: Option<String>,
    /// Open the existing RADOS store in this namespace (headroom-<16 hex>; e.g. another
    /// node's, to take it over) [default: the data directory's, or a new one].
    #[arg(long, value_name = "NS")]
    rados_namespace: Option<String>,
    /// The node's lease on a RADOS store lasts this long without renewal [default: 30000].
    #[arg(long, value_name = "MS")]
    rados_lease_ms: Option<u64>,
    /// Wait at most this long at start for another node's lease to expire [default: no limit].
    #[arg(long, value_name = "MS")]
    rados_lease_wait_ms: Option<u64>,
    /// After losing the lease, keep answering /readyz (503, naming the loss) this long, then
    /// exit with status 3 [default: 5000].
    #[arg(long, value_name = "MS")]
    rados_lease_lost_linger_ms: Option<u64>,
    /// Share the RADOS pool's capacity with the other nodes on it: report demand every
    /// epoch, and pace this node at the share the arbiter gives it (with --rados-capacity-iops).
    #[arg(long)]
    rados_arbitration: bool,
    /// The pool's capacity all nodes share, operations per second (with --rados-arbitration).
    #[arg(long, value_name = "IOPS")]
    rados_capacity_iops: Option<u64>,
    /// The pool's capacity all nodes share, bytes per second (e.g. 400MiB) [default: IOPS only].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    rados_capacity_bytes_per_s: Option<u64>,
    /// This node's id among the nodes on the pool [default: <hostname>-<NBD port>].
    #[arg(long, value_name = "ID")]
    rados_node_id: Option<String>,
    /// This node's weight in the split of what baselines leave [default: 1].
    #[arg(long, value_name = "N")]
    rados_weight: Option<u64>,
    /// How often nodes report and the arbiter splits [default: 500].
    #[arg(long, value_name = "MS")]
    rados_arbitration_epoch_ms: Option<u64>,
    /// Refuse to create or grow a volume when the volume sizes would sum to more than this
    /// many times the pool capacity (a number >= 1.0) [default: no limit].
    #[arg(long, value_name = "RATIO")]
    overcommit_ratio: Option<f64>,
    /// Worker threads executing block I/O (0 = inline on the network threads) [default: 2].
    #[arg(long)]
    io_threads: Option<usize>,
    /// Requests moving at most this many bytes run inline on the network threads
    /// [default: 64KiB when every device is in RAM (--memory, or device files on tmpfs), else 0].
    #[arg(long, value_parser = parse_inline_bytes)]
    inline_max_bytes: Option<u32>,
    /// Microseconds a network thread about to sleep waits for more requests, to answer
    /// several per wake-up; adaptive, 0 = off
    /// [default: 10 with --memory or --rados-conf, 0 with device files].
    #[arg(long)]
    coalesce_us: Option<u64>,
    /// Threads that own the NBD connections (each connection lives on one, reader and writer
    /// together); 0 = connections share the async runtime's threads [default: one per CPU].
    #[arg(long)]
    net_threads: Option<usize>,
    /// Maximum NBD connections at once [default: 256].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Maximum requests in flight per connection [default: 256].
    #[arg(long)]
    max_inflight_requests: Option<usize>,
    /// Offer TLS with these pre-shared keys: `identity:hexkey` lines, as qemu's `keys.psk`
    /// (needs a build with --features tls).
    #[arg(long, value_name = "FILE")]
    tls_psk_file: Option<PathBuf>,
    /// Offer TLS with the X.509 credentials in DIR: server-cert.pem, server-key.pem, and
    /// ca-cert.pem to require and verify client certificates (qemu's layout).
    #[arg(long, value_name = "DIR")]
    tls_cert_dir: Option<PathBuf>,
    /// Refuse clients that do not start TLS (NBD_REP_ERR_TLS_REQD).
    #[arg(long)]
    tls_required: bool,
    /// The tenant a client certificate acts for: CN=TENANT, split at the first `=`
    /// (repeatable; required with ca-cert.pem; a CN holding `=` needs the configuration
    /// file's [tls.certificate_tenants]).
    #[arg(long, value_name = "CN=TENANT")]
    tls_cert_tenant: Vec<String>,
    /// Also offer TLS 1.2 suites without forward secrecy (plain PSK) and CBC suites.
    #[arg(long)]
    tls_legacy_ciphers: bool,
    /// Log lines on stderr as text (no colour unless stderr is a terminal) or as one JSON
    /// object per line (for journald, Loki, Elasticsearch).
    #[arg(long, value_enum, env = "HEADROOM_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human line per event.
    Text,
    /// One JSON object per event: timestamp, level, target, fields.
    Json,
}

/// The exit codes, for `--help` (and docs/operations.md, "Exit codes"; a shared contract).
const EXIT_CODES: &str = "\
Exit codes:
  0  success (also when the reader of stdout went away, as in `| head`)
  1  other failure
  2  usage error (bad flags or arguments)
  3  not found (the API answered 404: no such volume)
  4  server unreachable (is `headroom serve` running? --api or HEADROOM_API)
  5  authentication failed (the API answered 401: check HEADROOM_TOKEN)
  6  conflict (the API answered 409: name taken, tenant still has volumes)";

impl ServeArgs {
    /// The flags as the top configuration layer.
    fn layer(&self) -> serve_config::ConfigFile {
        use serve_config::{
            ConfigFile, LimitsSection, QosSection, ServerSection, Size, StorageSection, TlsSection,
        };
        ConfigFile {
            server: ServerSection {
                nbd_listen: self.nbd_listen,
                api_listen: self.api_listen,
                io_threads: self.io_threads,
                inline_max_bytes: self.inline_max_bytes.map(|b| Size(u64::from(b))),
                coalesce_us: self.coalesce_us,
                net_threads: self.net_threads,
            },
            storage: StorageSection {
                data_dir: self.data_dir.clone(),
                overcommit_ratio: self.overcommit_ratio,
                memory: self.memory.map(Size),
                devices: self.devices,
                device_size: self.device_size.map(Size),
                device_paths: (!self.device_paths.is_empty()).then(|| self.device_paths.clone()),
                device_dirs: None,
                block_devices: None,
                max_device_bytes: None,
                max_volume_bytes: None,
                metadata_reserve: None,
                read_routing: None,
                rados_conf: self.rados_conf.clone(),
                rados_pool: self.rados_pool.clone(),
                rados_id: self.rados_id.clone(),
                rados_namespace: self.rados_namespace.clone(),
                rados_lease_ms: self.rados_lease_ms,
                rados_lease_wait_ms: self.rados_lease_wait_ms,
                rados_lease_lost_linger_ms: self.rados_lease_lost_linger_ms,
                rados_arbitration: self.rados_arbitration.then_some(true),
                rados_capacity_iops: self.rados_capacity_iops,
                rados_capacity_bytes_per_s: self.rados_capacity_bytes_per_s.map(Size),
                rados_node_id: self.rados_node_id.clone(),
                rados_weight: self.rados_weight,
                rados_arbitration_epoch_ms: self.rados_arbitration_epoch_ms,
                emulated: None,
                rebuild: None,
                scrub: None,
                checksums: None,
            },
            limits: LimitsSection {
                max_connections: self.max_connections,
                max_inflight_requests: self.max_inflight_requests,
                ..LimitsSection::default()
            },
            qos: QosSection {
                policy: self.policy,
                ..QosSection::default()
            },
            tls: TlsSection {
                psk_file: self.tls_psk_file.clone(),
                cert_dir: self.tls_cert_dir.clone(),
                required: self.tls_required.then_some(true),
                certificate_tenants: (!self.tls_cert_tenant.is_empty()).then(|| {
                    self.tls_cert_tenant
                        .iter()
                        .map(|pair| match pair.split_once('=') {
                            Some((cn, tenant)) => (cn.to_string(), tenant.to_string()),
                            // Refused by the check: an empty tenant id is not one.
                            None => (pair.clone(), String::new()),
                        })
                        .collect()
                }),
                legacy_cipher_suites: self.tls_legacy_ciphers.then_some(true),
                handshakes_per_s_per_address: None,
            },
            metrics: serve_config::MetricsSection::default(),
            api: serve_config::ApiSection::default(),
            faults: None,
        }
    }
}

#[derive(Args, Debug)]
struct DemoArgs {
    #[command(flatten)]
    serve: ServeArgs,
    /// Name of the sample volume.
    #[arg(long, default_value = "demo")]
    volume: String,
    /// Size of the sample volume if it has to be created.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
}

fn main() -> ExitCode {
    // Usage errors exit 2 here, with clap's message.
    let cli = Cli::parse();
    if let Command::Check(args) = &cli.command {
        return check_cmd::run(args);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = exit_code(&err);
            eprintln!("error: {}", chain_text(&err));
            if let Some(hint) = hint(code) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(code)
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(args) => {
            init_logging("info", args.log_format);
            runtime()?.block_on(serve(args, None))
        }
        Command::Demo(args) => {
            init_logging("info", args.serve.log_format);
            runtime()?.block_on(serve(args.serve, Some((args.volume, args.size))))
        }
        Command::Pool(args) => pool_cmd::run(args),
        Command::Arbitration(args) => arbitration_cmd::run(args),
        Command::Device(command) => device_cmd::run(command),
        Command::Volume(command) => volume_cmd::run(command),
        Command::Rebuild(command) => rebuild_cmd::run(command),
        Command::Scrub(command) => scrub_cmd::run(command),
        Command::Tenant(command) => tenant_cmd::run(command),
        Command::Token(command) => token_cmd::run(command),
        Command::Qos(command) => qos_cmd::run(command),
        Command::Sim(command) => sim_cmd::run(command),
        Command::Lab(command) => lab_cmd::run(command),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Top(args) => top::run(args),
        // Handled in `main`: it has exit codes of its own.
        Command::Check(_) => Ok(()),
    }
}

/// The one place an error becomes an exit code: a typed API failure (`client::ApiCallError`)
/// anywhere in the error's chain gives its code, anything else is 1.
/// The error and its causes, like `{:#}`, without a cause whose text the message before it
/// already holds (errors whose message includes their source's would repeat it).
fn chain_text(err: &anyhow::Error) -> String {
    let mut out = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

fn exit_code(err: &anyhow::Error) -> u8 {
    client::exit_code_of(err)
}

/// What to try, for the codes whose message may not say it.
fn hint(code: u8) -> Option<&'static str> {
    match code {
        client::EXIT_NOT_FOUND => {
            Some("`headroom volume list` and `headroom tenant list` show what there is")
        }
        _ => None,
    }
}

fn parse_policy(text: &str) -> Result<PolicyChoice, String> {
    text.parse()
}

fn parse_inline_bytes(text: &str) -> Result<u32, String> {
    let bytes = parse_size(text).map_err(|err| err.to_string())?;
    u32::try_from(bytes).map_err(|_| format!("{text} is larger than 4 GiB"))
}

/// Logs to stderr at `default_level` unless `HEADROOM_LOG` says otherwise (tracing filter
/// syntax), as text or JSON lines. Colour only when stderr is a terminal and `NO_COLOR` is
/// unset: a log file or journald gets no escape codes.
pub fn init_logging(default_level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEADROOM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(colour).init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("headroom-net")
        .on_thread_start(headroom_node::coalesce::on_worker_start)
        .on_thread_park(headroom_node::coalesce::on_worker_park)
        .on_thread_unpark(headroom_node::coalesce::on_worker_unpark)
        .build()
        .context("starting the async runtime")
}

async fn serve(args: ServeArgs, sample: Option<(String, u64)>) -> Result<()> {
    let mut loaded = serve_config::load(args.layer(), args.config.as_deref())?;
    let (api_token, token_origin) = token::server_token(&loaded.token)?;
    loaded.node.api_token = Some(api_token.clone());
    loaded.node.config_file = loaded.config_file.clone();
    loaded.node.calibration_file = loaded.calibration_file.clone();
    if let Some(path) = &loaded.config_file {
        tracing::info!("configuration file {}", path.display());
    }
    if let Some(path) = &loaded.calibration_file {
        tracing::info!(
            "calibration {} (under the configuration file and flags)",
            path.display()
        );
    }
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    let place = match &loaded.node.backend {
        StoreBackend::Memory { capacity_bytes } => {
            format!("in memory ({})", format_size(*capacity_bytes))
        }
        StoreBackend::Files { data_dir, .. } => format!("on {}", data_dir.display()),
        StoreBackend::Rados { data_dir, pool, .. } => {
            format!(
                "on RADOS pool {pool} (local state in {})",
                data_dir.display()
            )
        }
    };
    let linger_ms = match &loaded.node.backend {
        StoreBackend::Rados {
            lease_lost_linger_ms,
            ..
        } => *lease_lost_linger_ms,
        _ => 0,
    };
    let node = Node::start(loaded.node)
        .await
        .with_context(|| format!("starting the server {place}"))?;
    if token_origin == token::Origin::Ephemeral {
        // Nowhere to keep it: the operator reads it here, once.
        eprintln!(
            "API token for this run (--memory without --data-dir; set HEADROOM_TOKEN to choose one): {}",
            api_token.expose()
        );
    } else {
        tracing::info!("API token {token_origin}");
    }
    if !node.api_addr.ip().is_loopback() {
        tracing::warn!(
            "the management API listens on {}, which is not a loopback address: it has no TLS, \
             so its bearer token and answers cross the network in clear text (put it behind a \
             TLS proxy or a private network)",
            node.api_addr
        );
    }
    // Before the ready line: no client request runs without the faults asked for.
    if let Some(faults) = &loaded.faults {
        node.store()
            .inject_faults(faults)
            .context("fault injection ([faults])")?;
        tracing::warn!(
            "fault injection is ON: {} rule(s), seed {} (a testing tool; docs/operations.md)",
            faults.rules.len(),
            faults.seed
        );
    }

    if let Some((name, size_bytes)) = sample {
        // Two sample volumes: one unlimited, one with QEMU's burst class, to compare.
        let capped = format!("{name}-qos");
        let samples = [
            (name.clone(), None),
            (
                capped.clone(),
                Some(headroom_qos::QosSpec {
                    preset: Some(DEMO_QOS_CLASS.to_string()),
                    ..headroom_qos::QosSpec::default()
                }),
            ),
        ];
        for (sample_name, spec) in samples {
            if node.store().volume_info(&sample_name).is_ok() {
                continue;
            }
            tokio::task::block_in_place(|| node.create_volume(&sample_name, size_bytes, spec))
                .with_context(|| format!("creating the sample volume {sample_name}"))?;
        }
        let client = DemoClient::new(&token_origin, api_token.expose());
        print_demo_help(
            &name,
            &capped,
            size_bytes,
            node.nbd_addr,
            node.api_addr,
            &client,
        );
    }
    // Handlers first: a script that sends SIGTERM as soon as it reads the line below must
    // get a clean stop, not the default action.
    let stop = stop_signal()?;
    // Printed for scripts and tests that start us on port 0. A closed stdout must not stop
    // a server: the write's error is ignored.
    say(&format!(
        "nbd://{}  api http://{}\n",
        node.nbd_addr, node.api_addr
    ));
    // systemd (Type=notify): ready once both listeners are bound, as the line above says.
    // STATUS is what `systemctl status headroom` shows.
    sd_notify::notify(&format!(
        "READY=1\nSTATUS=serving NBD on {}, API on http://{}",
        node.nbd_addr, node.api_addr
    ));

    tokio::pin!(stop);
    let lost = tokio::select! {
        () = &mut stop => None,
        loss = node.lease_lost() => Some(loss),
    };
    if let Some(loss) = lost {
        // Another node may serve the store now: serve nothing, say why for a while (/readyz
        // 503, the readiness metric 0), then exit for the supervisor to restart us as a
        // standby. Nothing is flushed: the store refuses every I/O since the loss.
        node.stop_nbd();
        sd_notify::notify(&format!(
            "STATUS=lost the store's lease ({}); exiting with status {} in {linger_ms} ms",
            loss.why,
            headroom_store::LEASE_LOST_EXIT_STATUS
        ));
        tracing::error!(
            why = loss.why.as_str(),
            linger_ms,
            exit_status = headroom_store::LEASE_LOST_EXIT_STATUS,
            "lost the store's lease: serving nothing; /readyz answers 503 until the process exits"
        );
        tokio::select! {
            () = tokio::time::sleep(std::time::Duration::from_millis(linger_ms)) => {}
            () = &mut stop => {}
        }
        tracing::info!("exiting after the loss of the store's lease");
        std::process::exit(headroom_store::LEASE_LOST_EXIT_STATUS);
    }
    sd_notify::notify("STOPPING=1\nSTATUS=stopping: flushing devices and metadata");
    tracing::info!("shutting down: flushing");
    node.shutdown().await.context("clean shutdown")?;
    tracing::info!("stopped");
    Ok(())
}

/// Installs the SIGTERM and SIGINT handlers now; the future ends at the first of them.
fn stop_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// The sample QoS volume's class: 5,000 IOPS for about 12 s, then 1,000.
const DEMO_QOS_CLASS: &str = "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10";

/// How the demo's printed `headroom` commands reach this server from another terminal: this
/// very binary by its absolute path (`cargo run` puts none on the PATH), and the token the
/// server uses, by its file where there is one.
struct DemoClient {
    /// The start of every printed `headroom` command line.
    prefix: String,
    /// The flags after its arguments.
    suffix: String,
}

impl DemoClient {
    fn new(origin: &token::Origin, ephemeral_token: &str) -> DemoClient {
        let exe = std::env::current_exe()
            .ok()
            .and_then(|p| p.to_str().map(shell_word))
            .unwrap_or_else(|| "headroom".to_string());
        let (env, suffix) = match origin {
            token::Origin::TokenFile(path) | token::Origin::CreatedTokenFile(path) => {
                let path = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                let file = path.to_str().map(shell_word).unwrap_or_default();
                (String::new(), format!(" --token-file {file}"))
            }
            // Printed to stderr already: nowhere else to find it.
            token::Origin::Ephemeral => {
                (format!("HEADROOM_TOKEN={ephemeral_token} "), String::new())
            }
            // The operator's own setting: the same variable in the other terminal.
            token::Origin::Environment | token::Origin::ConfigFile => {
                (String::new(), String::new())
            }
        };
        DemoClient {
            prefix: format!("{env}{exe}"),
            suffix,
        }
    }
}

/// `word` as one shell word (quoted when it holds anything but `[A-Za-z0-9/._+=:-]`).
fn shell_word(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._+-=:".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// The demo's banner: what it serves and commands to try, each of which works as printed on a
/// machine with the Debian packages the first line names (`cli.rs` runs every one).
fn print_demo_help(
    name: &str,
    capped: &str,
    size_bytes: u64,
    nbd: SocketAddr,
    api: SocketAddr,
    client: &DemoClient,
) {
    let uri = format!("nbd://{nbd}/{name}");
    let capped_uri = format!("nbd://{nbd}/{capped}");
    let headroom = |args: &str| {
        format!(
            "HEADROOM_API=http://{api} {} {args}{}",
            client.prefix, client.suffix
        )
    };
    say(&format!(
        "\nHeadroom is serving volume {name:?} ({size}, no QoS limit) at {uri}\n\
         and {capped:?} ({size}, QoS class {DEMO_QOS_CLASS}) at {capped_uri}\n\n\
         Try, from another terminal (the clients are Debian's packages; as root:\n\
         apt-get install -y libnbd-bin qemu-utils fio):\n  \
         nbdinfo {uri}\n  \
         qemu-img info {uri}\n  \
         qemu-img create -f qcow2 /tmp/headroom-demo.qcow2 64M && qemu-img convert -n -O raw /tmp/headroom-demo.qcow2 {uri}\n  \
         fio --name=demo --ioengine=nbd --uri={uri} --rw=randrw --bs=4k --iodepth=32 --size=256M --runtime=10 --time_based\n\n\
         QoS at work: the same load on {capped:?} bursts at 5,000 IOPS for about 12 s, then runs at 1,000:\n  \
         fio --name=qos --ioengine=nbd --uri={capped_uri} --rw=randread --bs=4k --iodepth=32 --size=256M --runtime=20 --time_based --status-interval=1\n  \
         {show}     # credits and I/Os per phase\n  \
         {list}\n\n\
         Stop with Ctrl-C (data is flushed and credit balances saved first).\n\n",
        size = format_size(size_bytes),
        show = headroom(&format!("volume show {capped}")),
        list = headroom("volume list"),
    ));
}

/// Writes to stdout for `serve`/`demo`, ignoring errors: a server keeps running when nobody
/// reads its stdout any more.
fn say(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}
