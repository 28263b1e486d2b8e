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

/// Flags of `serve` and `demo`. Every setting is optional: a flag given here overrides the
/// `--config` file, which overrides `DATA_DIR/calibration.toml`, which overrides the built-in
/// defaults (shown in brackets). The settings' flags are declared on the configuration's
/// sections (serve_config), beside their keys in the file.
#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Read settings from this TOML file (docs/configuration.md).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log lines on stderr as text (no colour unless stderr is a terminal) or as one JSON
    /// object per line (for journald, Loki, Elasticsearch).
    #[arg(long, value_enum, env = "HEADROOM_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// The command line's configuration layer.
    #[command(flatten)]
    settings: serve_config::ConfigFile,
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
    let mut loaded = serve_config::load(args.settings, args.config.as_deref())?;
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
        print_demo_help(&name, &capped, size_bytes, &node, node.api_addr, &client);
    }
    // Handlers first: a script that sends SIGTERM as soon as it reads the line below must
    // get a clean stop, not the default action.
    let stop = stop_signal()?;
    // Printed for scripts and tests that start us on port 0. A closed stdout must not stop
    // a server: the write's error is ignored.
    // With both doors, the Unix socket's line comes first: a reader that waits for the
    // `nbd://` line has both when it gets it.
    let unix_line = node
        .nbd_unix
        .as_ref()
        .map(|path| format!("nbd+unix:///?socket={}", path.display()));
    let ready = match (&node.nbd_addr, &unix_line) {
        (Some(addr), Some(unix)) => format!("{unix}\nnbd://{addr}  api http://{}\n", node.api_addr),
        (Some(addr), None) => format!("nbd://{addr}  api http://{}\n", node.api_addr),
        (None, Some(unix)) => format!("{unix}  api http://{}\n", node.api_addr),
        (None, None) => format!("api http://{}\n", node.api_addr),
    };
    say(&ready);
    // systemd (Type=notify): ready once every listener is bound, as the lines above say.
    // STATUS is what `systemctl status headroom` shows.
    let doors: Vec<String> = node
        .nbd_addr
        .map(|a| a.to_string())
        .into_iter()
        .chain(
            node.nbd_unix
                .as_ref()
                .map(|p| format!("unix:{}", p.display())),
        )
        .collect();
    sd_notify::notify(&format!(
        "READY=1\nSTATUS=serving NBD on {}, API on http://{}",
        doors.join(" and "),
        node.api_addr
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
    node: &headroom_node::RunningNode,
    api: SocketAddr,
    client: &DemoClient,
) {
    let uri_of = |export: &str| match (&node.nbd_addr, &node.nbd_unix) {
        (Some(nbd), _) => format!("nbd://{nbd}/{export}"),
        (None, Some(path)) => format!("nbd+unix:///{export}?socket={}", path.display()),
        (None, None) => String::new(),
    };
    let uri = uri_of(name);
    let capped_uri = uri_of(capped);
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
