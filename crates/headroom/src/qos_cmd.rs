//! `headroom qos preview`: how a QoS class answers a steady demand, second by second, computed
//! by the same bucket code the server runs (headroom-qos), so an operator can check a class
//! against the product sheet before selling it.

use anyhow::{Result, anyhow};
use clap::Subcommand;
use headroom_qos::presets::Preset;
use headroom_qos::preview::{PreviewRequest, preview};

use crate::output::{Align, Table, bytes_rate, grouped, print_json};
use crate::size::parse_size;

#[derive(Subcommand, Debug)]
pub enum QosCommand {
    /// Show a preset's answer to a steady demand over time.
    Preview {
        /// gp2, gp3, io2, azure-credit, azure-ondemand, autopl, or
        /// qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10
        #[arg(long)]
        preset: String,
        /// Volume size (presets such as gp2 scale with it).
        #[arg(long, default_value = "100GiB", value_parser = parse_size)]
        size: u64,
        /// Offered IOPS (default: as many as the class allows).
        #[arg(long)]
        demand_iops: Option<u64>,
        /// Offered MB/s (10^6 bytes per second).
        #[arg(long)]
        demand_mbps: Option<u64>,
        /// Size of each I/O.
        #[arg(long, default_value = "16KiB", value_parser = parse_size)]
        io_size: u64,
        /// Seconds to simulate.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Print JSON: {"rows": [{"t_s", "iops", "bytes_per_s", "credit_balance"}, ...]}
        /// (the table shows the same per second, in human units).
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: QosCommand) -> Result<()> {
    match command {
        QosCommand::Preview {
            preset,
            size,
            demand_iops,
            demand_mbps,
            io_size,
            seconds,
            json,
        } => {
            let preset = Preset::parse(&preset).map_err(|err| anyhow!("{err}"))?;
            let request = PreviewRequest {
                preset,
                size_bytes: size,
                demand_iops,
                demand_bytes_per_s: demand_mbps.map(|mbps| mbps.saturating_mul(1_000_000)),
                io_size_bytes: io_size,
                seconds,
            };
            let rows = preview(&request).map_err(|err| anyhow!("{err}"))?;
            if json {
                return print_json(&serde_json::json!({ "rows": rows }));
            }
            let mut table = Table::new(&[
                ("T_S", Align::Right),
                ("IOPS", Align::Right),
                ("THROUGHPUT", Align::Right),
                ("CREDITS", Align::Right),
            ]);
            for row in &rows {
                table.row(vec![
                    row.t_s.to_string(),
                    grouped(row.iops),
                    bytes_rate(row.bytes_per_s),
                    row.credit_balance.map_or_else(|| "-".to_string(), grouped),
                ]);
            }
            table.print();
            Ok(())
        }
    }
}
