//! `headroom`: the one binary. Serves volumes over NBD (`serve`, `demo`), manages them through
//! the node's HTTP API (`volume ...`), previews QoS classes (`qos preview`) and runs the
//! simulator (`sim run`).

mod client;
mod qos_cmd;
mod sim_cmd;
mod size;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use headroom_node::{Limits, Node, NodeConfig, StoreBackend};

use crate::size::{format_size, parse_size};

#[derive(Parser, Debug)]
#[command(
    name = "headroom",
    version,
    about = "Multi-tenant, burst-aware NBD block storage"
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
    /// Manage volumes through a running server's API.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Quality-of-service tools.
    #[command(subcommand)]
    Qos(qos_cmd::QosCommand),
    /// The discrete-event simulator.
    #[command(subcommand)]
    Sim(sim_cmd::SimCommand),
}

#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Directory for device files and metadata (created if missing).
    #[arg(long, default_value = "./headroom-data")]
    data_dir: PathBuf,
    /// NBD listen address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd_listen: SocketAddr,
    /// Management API listen address.
    #[arg(long, default_value = "127.0.0.1:10810")]
    api_listen: SocketAddr,
    /// Keep everything in RAM with this pool capacity (e.g. 4GiB) instead of the data directory.
    #[arg(long, value_parser = parse_size)]
    memory: Option<u64>,
    /// Number of device files in a new data directory.
    #[arg(long, default_value_t = 2)]
    devices: u32,
    /// Capacity of each device file in a new data directory (sparse).
    #[arg(long, default_value = "64GiB", value_parser = parse_size)]
    device_size: u64,
    /// Use this existing block device or file as a pool device (repeatable; replaces the
    /// created device files).
    #[arg(long = "device")]
    device_paths: Vec<PathBuf>,
    /// Worker threads executing block I/O (0 = inline on the network threads).
    #[arg(long, default_value_t = 2)]
    io_threads: usize,
    /// Requests moving at most this many bytes run inline on the network threads
    /// (default: 64KiB with --memory, 0 with a data directory).
    #[arg(long, value_parser = parse_inline_bytes)]
    inline_max_bytes: Option<u32>,
    /// Maximum NBD connections at once.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// Maximum requests in flight per connection.
    #[arg(long, default_value_t = Limits::default().max_inflight_requests_per_conn)]
    max_inflight_requests: usize,
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

#[derive(Subcommand, Debug)]
enum VolumeCommand {
    /// Create a volume.
    Create {
        name: String,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// List volumes.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Show one volume.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Change a volume's size.
    Resize {
        name: String,
        #[arg(long, value_parser = parse_size)]
        size: u64,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Delete a volume and free its space.
    Delete {
        name: String,
        #[command(flatten)]
        api: ApiArgs,
    },
}

#[derive(Args, Debug)]
struct ApiArgs {
    /// Base URL of the management API.
    #[arg(
        long = "api",
        env = "HEADROOM_API",
        default_value = "http://127.0.0.1:10810"
    )]
    url: String,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            init_logging();
            runtime()?.block_on(serve(args, None))
        }
        Command::Demo(args) => {
            init_logging();
            runtime()?.block_on(serve(args.serve, Some((args.volume, args.size))))
        }
        Command::Volume(command) => volume(command),
        Command::Qos(command) => qos_cmd::run(command),
        Command::Sim(command) => sim_cmd::run(command),
    }
}

fn parse_inline_bytes(text: &str) -> Result<u32, String> {
    let bytes = parse_size(text).map_err(|err| err.to_string())?;
    u32::try_from(bytes).map_err(|_| format!("{text} is larger than 4 GiB"))
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEADROOM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("headroom-net")
        .build()
        .context("starting the async runtime")
}

async fn serve(args: ServeArgs, sample: Option<(String, u64)>) -> Result<()> {
    let backend = match args.memory {
        Some(capacity_bytes) => StoreBackend::Memory { capacity_bytes },
        None => StoreBackend::Files {
            data_dir: args.data_dir.clone(),
            device_count: args.devices,
            device_capacity_bytes: args.device_size,
            device_paths: args.device_paths.clone(),
        },
    };
    let mut config = NodeConfig::new(backend);
    config.nbd_listen = args.nbd_listen;
    config.api_listen = args.api_listen;
    config.io_threads = args.io_threads;
    config.inline_max_bytes = args.inline_max_bytes;
    config.limits.max_connections = args.max_connections;
    config.limits.max_inflight_requests_per_conn = args.max_inflight_requests;
    let node = Node::start(config)
        .await
        .with_context(|| format!("starting the server on {}", args.data_dir.display()))?;

    if let Some((name, size_bytes)) = sample {
        let store = std::sync::Arc::clone(node.store());
        let existing = store.volume_info(&name).ok();
        let info = match existing {
            Some(info) => info,
            None => tokio::task::spawn_blocking(move || store.create_volume(&name, size_bytes))
                .await?
                .context("creating the sample volume")?,
        };
        print_demo_help(&info.name, info.size_bytes, node.nbd_addr, node.api_addr);
    }
    // Printed for scripts and tests that start us on port 0.
    println!("nbd://{}  api http://{}", node.nbd_addr, node.api_addr);

    wait_for_signal().await?;
    tracing::info!("shutting down: flushing");
    node.shutdown().await.context("clean shutdown")?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

fn print_demo_help(name: &str, size_bytes: u64, nbd: SocketAddr, api: SocketAddr) {
    let uri = format!("nbd://{nbd}/{name}");
    println!(
        "\nHeadroom is serving volume {name:?} ({size}) at {uri}\n\n\
         Try, from another terminal:\n  \
         nbdinfo {uri}\n  \
         qemu-img info {uri}\n  \
         qemu-img convert -n -O raw some-image.raw {uri}\n  \
         fio --name=demo --ioengine=nbd --uri={uri} --rw=randrw --bs=4k --iodepth=32 --size=256M --runtime=10 --time_based\n  \
         HEADROOM_API=http://{api} headroom volume list\n\n\
         Stop with Ctrl-C (data is flushed first).\n",
        size = format_size(size_bytes),
    );
}

fn volume(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Create { name, size, api } => {
            let info = client::Api::new(&api.url).create(&name, size)?;
            println!("created {} ({})", info.name, format_size(info.size_bytes));
        }
        VolumeCommand::List { json, api } => {
            let volumes = client::Api::new(&api.url).list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&volumes)?);
            } else {
                println!("{:<32} {:>12} {:>12}", "NAME", "SIZE", "ALLOCATED");
                for info in volumes {
                    println!(
                        "{:<32} {:>12} {:>12}",
                        info.name,
                        format_size(info.size_bytes),
                        format_size(info.allocated_bytes)
                    );
                }
            }
        }
        VolumeCommand::Show { name, json, api } => {
            let info = client::Api::new(&api.url).show(&name)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&info)?);
            } else {
                println!("name:       {}", info.name);
                println!("id:         {}", info.id);
                println!(
                    "size:       {} ({} bytes)",
                    format_size(info.size_bytes),
                    info.size_bytes
                );
                println!("allocated:  {} bytes", info.allocated_bytes);
                println!("created:    {} (unix seconds)", info.created_unix_s);
            }
        }
        VolumeCommand::Resize { name, size, api } => {
            let info = client::Api::new(&api.url).resize(&name, size)?;
            println!("resized {} to {}", info.name, format_size(info.size_bytes));
        }
        VolumeCommand::Delete { name, api } => {
            client::Api::new(&api.url).delete(&name)?;
            println!("deleted {name}");
        }
    }
    Ok(())
}
