//! `headroom device list`: each device of the pool with what it is doing now — the smoothed
//! rates, mean latencies and write cost of the store's telemetry — from `GET /v1/devices`.
//!
//! Why apart from `headroom pool`: the pool view answers "how full", this one "how busy";
//! placement and read routing decide on the second, and an operator looking for a slow or
//! failing device needs it per device. Read as loose JSON, like `pool`: a server without
//! telemetry still gets its rows, with dashes.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::client::ApiArgs;
use crate::outln;
use crate::output::{Align, Table, emit, human_bytes, mb_per_s, print_json};
use crate::size::parse_size;

#[derive(Subcommand, Debug)]
pub enum DeviceCommand {
    /// Each device: state, and its smoothed IOPS, bandwidth, latency and write cost.
    List(DeviceListArgs),
    /// Add a device to the running pool: new extents may go there at once, and it stays
    /// after a restart (file pools only).
    Add(DeviceAddArgs),
    /// Fail a device for good (recorded durably): nothing is allocated, written or (while
    /// another copy exists) read there again. Replicated volumes go on from their other
    /// copies, `degraded`; a 1-replica volume with extents there fails its FLUSHes.
    Fail(DeviceFailArgs),
    /// Return a failed device to service once its cause is fixed: extents on it no volume
    /// maps are freed, the copies of replicated volumes there are made equal to a healthy
    /// copy, then the failed flag is cleared durably and its error count reset. A device
    /// that still fails is refused; one in service is left alone.
    Restore(DeviceFailArgs),
}

#[derive(Args, Debug)]
pub struct DeviceFailArgs {
    /// The device id (`headroom device list`).
    id: u32,
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

#[derive(Args, Debug)]
pub struct DeviceAddArgs {
    /// A regular file under one of the server's device directories (`[storage]
    /// device_dirs`, default `DATA_DIR/devices/`; created there if it does not exist) or a
    /// block device named in `[storage] block_devices`; absent: a new sparse file
    /// `devices/dev-N.img` in the server's data directory.
    path: Option<String>,
    /// Length of a file that is created or empty (an existing file keeps its length), e.g.
    /// `100GiB`; rounded down to whole 2 MiB extents [default: 64GiB, sparse].
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// The failure domain the device is in (a host, a shelf, a power feed): the copies of
    /// a replicated volume's extents go to distinct domains when the pool has enough.
    #[arg(long, value_name = "DOMAIN")]
    failure_domain: Option<String>,
    /// Take a device that holds a filesystem, partition table or other signature, or any
    /// data, destroying its contents (without it such a device is refused, untouched).
    #[arg(long)]
    force: bool,
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

#[derive(Args, Debug)]
pub struct DeviceListArgs {
    /// Print the API's JSON (`GET /v1/devices`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

pub fn run(command: DeviceCommand) -> Result<()> {
    match command {
        DeviceCommand::List(args) => {
            let devices = args.api.client()?.get_json("/v1/devices")?;
            if args.json {
                return print_json(&devices);
            }
            emit(&render(&devices));
            Ok(())
        }
        DeviceCommand::Add(args) => {
            let device = args.api.client()?.add_device(
                args.path.as_deref(),
                args.size,
                args.failure_domain.as_deref(),
                args.force,
            )?;
            if args.json {
                return print_json(&device);
            }
            outln!(
                "added device {} ({}, {} extents) at {}",
                device.get("id").and_then(Value::as_u64).unwrap_or(0),
                human_bytes(
                    device
                        .get("capacity_bytes")
                        .and_then(Value::as_u64)
                        .unwrap_or(0)
                ),
                device
                    .get("extent_count")
                    .and_then(Value::as_u64)
                    .unwrap_or(0),
                device.get("path").and_then(Value::as_str).unwrap_or("?")
            );
            Ok(())
        }
        DeviceCommand::Restore(args) => {
            let r = args.api.client()?.restore_device(args.id)?;
            if args.json {
                return print_json(&r);
            }
            let n = |k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
            let path = r
                .get("device")
                .and_then(|d| d.get("path"))
                .and_then(Value::as_str)
                .unwrap_or("?");
            if r.get("restored").and_then(Value::as_bool) != Some(true) {
                outln!(
                    "device {} ({path}) is in service already: nothing done",
                    args.id
                );
                return Ok(());
            }
            outln!(
                "device {} ({path}) is back in service: {} unmapped extents freed, {} copies \
                 checked, {} chunks rewritten, {} copies without a healthy source",
                args.id,
                n("extents_reclaimed"),
                n("copies_checked"),
                n("chunks_rewritten"),
                n("copies_without_source")
            );
            Ok(())
        }
        DeviceCommand::Fail(args) => {
            let device = args.api.client()?.fail_device(args.id)?;
            if args.json {
                return print_json(&device);
            }
            outln!(
                "device {} ({}) is failed: replicated volumes go on from their other copies",
                args.id,
                device.get("path").and_then(Value::as_str).unwrap_or("?")
            );
            Ok(())
        }
    }
}

fn number(value: Option<&Value>, key: &str) -> Option<f64> {
    value.and_then(|v| v.get(key)).and_then(Value::as_f64)
}

/// The device table, for people.
fn render(devices: &Value) -> String {
    let mut table = Table::new(&[
        ("DEVICE", Align::Right),
        ("STATE", Align::Left),
        ("READ IOPS", Align::Right),
        ("WRITE IOPS", Align::Right),
        ("READ", Align::Right),
        ("WRITE", Align::Right),
        ("READ LAT", Align::Right),
        ("WRITE LAT", Align::Right),
        ("WRITE COST", Align::Right),
        ("PATH", Align::Left),
    ]);
    let dash = || "-".to_string();
    for device in devices.as_array().map_or(&[][..], Vec::as_slice) {
        let t = device.get("telemetry");
        let failed = device.get("failed").and_then(Value::as_bool) == Some(true);
        table.row(vec![
            device
                .get("id")
                .and_then(Value::as_u64)
                .map_or_else(|| "?".to_string(), |id| id.to_string()),
            if failed { "FAILED" } else { "ok" }.to_string(),
            number(t, "read_iops").map_or_else(dash, |v| format!("{v:.0}")),
            number(t, "write_iops").map_or_else(dash, |v| format!("{v:.0}")),
            number(t, "read_bytes_per_s").map_or_else(dash, mb_per_s),
            number(t, "write_bytes_per_s").map_or_else(dash, mb_per_s),
            number(t, "read_latency_us").map_or_else(dash, |v| format!("{v:.0}us")),
            number(t, "write_latency_us").map_or_else(dash, |v| format!("{v:.0}us")),
            number(t, "write_cost").map_or_else(dash, |v| format!("{v:.2}")),
            device
                .get("path")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
        ]);
    }
    table.render(crate::output::stdout_styled())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_telemetry_and_dashes_where_it_is_unknown() {
        let devices = serde_json::json!([
            {"id": 0, "path": "/d/dev-0.img", "telemetry": {
                "version": 3, "read_iops": 1200.4, "write_iops": 10.0,
                "read_bytes_per_s": 4.9e6, "write_bytes_per_s": 40960.0,
                "read_latency_us": 85.2, "write_latency_us": 240.0, "write_cost": 2.8,
                "errors_per_s": 0.0, "interval_ms": 1000.0}},
            {"id": 1, "path": "memory:1", "failed": true}
        ]);
        let text = render(&devices);
        let row = |device: &str| {
            text.lines()
                .find(|l| l.split_whitespace().next() == Some(device))
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .unwrap()
        };
        let zero = row("0");
        assert_eq!(zero[..4], ["0", "ok", "1200", "10"]);
        assert_eq!(
            zero[zero.len() - 4..],
            ["85us", "240us", "2.80", "/d/dev-0.img"]
        );
        let line = text.lines().find(|l| l.contains("/d/dev-0.img")).unwrap();
        assert!(
            line.contains("4.9 MB/s") && line.contains("0.0 MB/s"),
            "{line}"
        );
        assert_eq!(
            row("1"),
            ["1", "FAILED", "-", "-", "-", "-", "-", "-", "-", "memory:1"]
        );
    }
}
