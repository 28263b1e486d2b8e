//! `headroom volume ...`: create, list, show, resize and delete volumes, and set their QoS,
//! through a running server's management API (see client.rs). A volume's tenant and access
//! mode (`--tenant`, `--read-only`) are given at creation.
//!
//! QoS flags build a [`QosSpec`]: `--qos PRESET` names a class the way `qos preview --preset`
//! spells it, and the other flags refine it (or, alone, make a custom class). The server
//! resolves and validates the spec; an invalid one is reported as `error: invalid QoS: ...`.

use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use headroom_node::api::{CreateVolume, VolumeView};
use headroom_node::volume_qos::{CreditsView, QosView, RateView};
use headroom_qos::{BurstKind, QosSpec};
use serde_json::Value;

use crate::client::ApiArgs;
use crate::size::{format_size, parse_size};

#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a volume (unlimited unless QoS flags are given).
    Create {
        /// Volume name, also the NBD export name.
        name: String,
        /// Size: 512MiB, 1GiB, 4k (binary), 2GB (decimal), or bytes.
        #[arg(long, value_parser = parse_size)]
        size: u64,
        /// The tenant it belongs to: only NBD clients whose TLS PSK identity or certificate
        /// CN is this id see it (1-128 printable ASCII characters). Without it, the volume
        /// is served to clients without an identity only. Fixed for the volume's life.
        #[arg(long, value_name = "ID")]
        tenant: Option<String>,
        /// Export it read-only: writes, trims and zeroing are refused (EPERM).
        #[arg(long)]
        read_only: bool,
        #[command(flatten)]
        qos: QosArgs,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// List volumes.
    List {
        /// Only this tenant's volumes.
        #[arg(long, value_name = "ID")]
        tenant: Option<String>,
        /// Print the API's JSON (`[VolumeView]`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Show one volume: size, QoS, credit balances and per-phase I/O counters.
    Show {
        name: String,
        /// Print the API's JSON (`VolumeView`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Change a volume's QoS live (flags given replace those set; a preset replaces the class);
    /// without flags, print its current QoS.
    Qos {
        name: String,
        #[command(flatten)]
        qos: QosArgs,
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

/// The QoS flags shared by `volume create` and `volume qos`.
#[derive(Args, Debug, Default)]
pub struct QosArgs {
    /// QoS class: gp2, gp3[:iops=N,throughput=MiBps], io2:iops=N, azure-credit,
    /// azure-ondemand, autopl[:provisioned-iops=N], or
    /// qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10
    #[arg(long = "qos", value_name = "PRESET")]
    preset: Option<String>,
    /// IOPS always available.
    #[arg(long, value_name = "N")]
    baseline_iops: Option<u64>,
    /// MB/s (10^6 bytes per second) always available.
    #[arg(long, value_name = "N")]
    baseline_mbps: Option<u64>,
    /// Most IOPS ever served.
    #[arg(long, value_name = "N")]
    ceiling_iops: Option<u64>,
    /// Most MB/s (10^6 bytes per second) ever served.
    #[arg(long, value_name = "N")]
    ceiling_mbps: Option<u64>,
    /// How the volume goes above its baseline.
    #[arg(long, value_enum)]
    burst: Option<BurstArg>,
    /// Share of spare capacity relative to other volumes (1-10000).
    #[arg(long, value_name = "N")]
    weight: Option<u32>,
}

/// `--burst` values (clap lists and checks them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BurstArg {
    /// Never above the baseline.
    None,
    /// On a credit bucket filled while below the baseline.
    Credits,
    /// On spare capacity, up to the ceiling.
    OnDemand,
}

impl From<BurstArg> for BurstKind {
    fn from(arg: BurstArg) -> Self {
        match arg {
            BurstArg::None => BurstKind::None,
            BurstArg::Credits => BurstKind::Credits,
            BurstArg::OnDemand => BurstKind::OnDemand,
        }
    }
}

impl QosArgs {
    /// The spec the flags ask for; `None` when no flag was given.
    fn spec(&self) -> Option<QosSpec> {
        let spec = QosSpec {
            preset: self.preset.clone(),
            baseline_iops: self.baseline_iops,
            baseline_mbps: self.baseline_mbps,
            ceiling_iops: self.ceiling_iops,
            ceiling_mbps: self.ceiling_mbps,
            burst: self.burst.map(BurstKind::from),
            weight: self.weight,
        };
        (spec != QosSpec::default()).then_some(spec)
    }
}

pub fn run(command: VolumeCommand) -> Result<()> {
    if let Err(err) = execute(command) {
        eprintln!("error: {err:#}");
        std::process::exit(i32::from(crate::client::exit_code_of(&err)));
    }
    Ok(())
}

fn execute(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Create {
            name,
            size,
            tenant,
            read_only,
            qos,
            api,
        } => {
            let body = CreateVolume {
                name,
                size_bytes: size,
                qos: qos.spec(),
                tenant,
                read_only,
            };
            let view = api.client()?.create(&body)?;
            let mut access = String::new();
            if let Some(tenant) = &view.info.tenant {
                access.push_str(&format!(", tenant {tenant}"));
            }
            if view.info.read_only {
                access.push_str(", read-only");
            }
            println!(
                "created {} ({}{access}), {}",
                view.info.name,
                format_size(view.info.size_bytes),
                qos_summary(view.qos_class.as_ref(), &view.credits)
            );
        }
        VolumeCommand::List { tenant, json, api } => {
            let api = api.client()?;
            let tenant = tenant.as_deref();
            if json {
                println!("{}", serde_json::to_string_pretty(&api.list_json(tenant)?)?);
            } else {
                print_list(&api.list(tenant)?);
            }
        }
        VolumeCommand::Show { name, json, api } => {
            let api = api.client()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&api.show_json(&name)?)?);
            } else {
                print_volume(&api.show(&name)?);
            }
        }
        VolumeCommand::Qos { name, qos, api } => {
            let api = api.client()?;
            let view = match qos.spec() {
                Some(change) => api.set_qos(&name, change)?,
                None => api.show(&name)?,
            };
            println!(
                "{}: {}",
                view.info.name,
                qos_summary(view.qos_class.as_ref(), &view.credits)
            );
        }
        VolumeCommand::Resize { name, size, api } => {
            let view = api.client()?.resize(&name, size)?;
            println!(
                "resized {} to {}",
                view.info.name,
                format_size(view.info.size_bytes)
            );
        }
        VolumeCommand::Delete { name, api } => {
            api.client()?.delete(&name)?;
            println!("deleted {name}");
        }
    }
    Ok(())
}

fn print_list(volumes: &[VolumeView]) {
    let rows: Vec<[String; 7]> = volumes
        .iter()
        .map(|view| {
            [
                view.info.name.clone(),
                view.info.tenant.clone().unwrap_or_else(|| "-".to_string()),
                access_column(view.info.read_only).to_string(),
                format_size(view.info.size_bytes),
                human_bytes(view.info.allocated_bytes),
                qos_column(view.qos_class.as_ref()),
                credits_column(&view.credits),
            ]
        })
        .collect();
    let width = |column: usize, header: &str| {
        rows.iter()
            .map(|row| row[column].chars().count())
            .chain([header.len()])
            .max()
            .unwrap_or(0)
    };
    let name_w = width(0, "NAME");
    let tenant_w = width(1, "TENANT");
    // QOS last: a QEMU preset spelled out is long.
    println!(
        "{:<name_w$}  {:<tenant_w$}  {:<6}  {:>10}  {:>10}  {:>12}  QOS",
        "NAME", "TENANT", "ACCESS", "SIZE", "ALLOCATED", "CREDITS"
    );
    for [name, tenant, access, size, allocated, qos, credits] in rows {
        println!(
            "{name:<name_w$}  {tenant:<tenant_w$}  {access:<6}  {size:>10}  {allocated:>10}  {credits:>12}  {qos}"
        );
    }
}

fn access_column(read_only: bool) -> &'static str {
    if read_only { "ro" } else { "rw" }
}

/// The preset (with `+` when refined), `custom` without one, `-` for an unlimited volume.
fn qos_column(qos: Option<&QosView>) -> String {
    let Some(qos) = qos else {
        return "-".to_string();
    };
    let (preset, refinements) = spec_parts(&qos.spec);
    match preset {
        Some(preset) if refinements.is_empty() => preset,
        Some(preset) => format!("{preset}+"),
        None => "custom".to_string(),
    }
}

fn credits_column(credits: &CreditsView) -> String {
    match (credits.iops, credits.bytes) {
        (Some(iops), None) => iops.to_string(),
        (None, Some(bytes)) => human_bytes(bytes),
        (Some(iops), Some(bytes)) => format!("{iops}+{}", human_bytes(bytes)),
        (None, None) => "-".to_string(),
    }
}

fn print_volume(view: &VolumeView) {
    let info = &view.info;
    println!("name:        {}", info.name);
    println!("id:          {}", info.id);
    println!(
        "size:        {} ({} bytes)",
        format_size(info.size_bytes),
        info.size_bytes
    );
    println!(
        "allocated:   {} ({} bytes)",
        human_bytes(info.allocated_bytes),
        info.allocated_bytes
    );
    println!("created:     {} (unix seconds)", info.created_unix_s);
    match &info.tenant {
        Some(tenant) => println!("tenant:      {tenant}"),
        None => println!("tenant:      - (served to NBD clients without a TLS identity)"),
    }
    println!(
        "access:      {}",
        if info.read_only {
            "read-only"
        } else {
            "read-write"
        }
    );
    println!("policy:      {}", view.policy);
    match &view.qos_class {
        None => println!("qos:         unlimited (no baseline promise, no ceiling)"),
        Some(qos) => {
            println!("qos:         {}", spec_label(&qos.spec));
            println!("  baseline:  {}", rate_full(&qos.baseline));
            println!("  ceiling:   {}", rate_full(&qos.ceiling));
            println!("  burst:     {}", qos.burst);
            println!("  weight:    {}", qos.weight);
            if qos.io_unit_bytes > 0 {
                println!(
                    "  io unit:   {} (larger requests count as several I/Os)",
                    human_bytes(u64::from(qos.io_unit_bytes))
                );
            }
            if let Some(bucket) = &qos.iops_bucket {
                println!(
                    "  iops bucket:  {} credits, refill {}/s",
                    bucket.capacity, bucket.refill_per_s
                );
            }
            if let Some(bucket) = &qos.bytes_bucket {
                println!(
                    "  bytes bucket: {}, refill {}/s",
                    human_bytes(bucket.capacity),
                    human_bytes(bucket.refill_per_s)
                );
            }
        }
    }
    let mut credits = Vec::new();
    if let Some(iops) = view.credits.iops {
        credits.push(format!("{iops} I/O credits"));
    }
    if let Some(bytes) = view.credits.bytes {
        credits.push(format!("{} of byte credits", human_bytes(bytes)));
    }
    if credits.is_empty() {
        credits.push("-".to_string());
    }
    println!("credits:     {}", credits.join(", "));
    println!("queued:      {} requests", view.queued_requests);
    println!();
    println!(
        "{:<24} {:>12} {:>12} {:>12} {:>16}",
        "PHASE", "I/OS", "BYTES", "TIME (S)", "MEAN (µS/I/O)"
    );
    let phases = &view.phases;
    for (label, phase) in [
        ("baseline", &phases.baseline),
        ("burst on credits", &phases.burst_credit),
        ("burst on spare capacity", &phases.burst_spare),
    ] {
        print_phase(label, phase.ios, Some(phase.bytes), phase.time_ns);
    }
    print_phase(
        "throttled (waiting)",
        phases.throttled.ios,
        None,
        phases.throttled.time_ns,
    );
}

fn print_phase(label: &str, ios: u64, bytes: Option<u64>, time_ns: u64) {
    let mean = if ios == 0 {
        "-".to_string()
    } else {
        format!("{:.1}", time_ns as f64 / ios as f64 / 1e3)
    };
    println!(
        "{:<24} {:>12} {:>12} {:>12.3} {:>16}",
        label,
        ios,
        bytes.map_or_else(|| "-".to_string(), human_bytes),
        time_ns as f64 / 1e9,
        mean
    );
}

/// One line: `qos gp2: baseline 300 IOPS, ceiling 3000 IOPS, credits 5400000`.
fn qos_summary(qos: Option<&QosView>, credits: &CreditsView) -> String {
    let Some(qos) = qos else {
        return "qos unlimited".to_string();
    };
    let mut parts = vec![
        format!("baseline {}", rate_short(&qos.baseline)),
        format!("ceiling {}", rate_short(&qos.ceiling)),
    ];
    match qos.burst.as_str() {
        "credits" => {
            if let Some(iops) = credits.iops {
                parts.push(format!("credits {iops}"));
            }
            if let Some(bytes) = credits.bytes {
                parts.push(format!("byte credits {}", human_bytes(bytes)));
            }
            if credits.iops.is_none() && credits.bytes.is_none() {
                parts.push("burst on credits".to_string());
            }
        }
        "on-demand" => parts.push("burst on demand".to_string()),
        "none" => parts.push("no burst".to_string()),
        other => parts.push(format!("burst {other}")),
    }
    if qos.weight != 1 {
        parts.push(format!("weight {}", qos.weight));
    }
    format!("qos {}: {}", spec_label(&qos.spec), parts.join(", "))
}

/// The preset (or `custom`) and the refinements as `flag=value`, from the spec's JSON so every
/// field the server knows is shown.
fn spec_parts(spec: &QosSpec) -> (Option<String>, Vec<String>) {
    let mut preset = None;
    let mut refinements = Vec::new();
    if let Ok(Value::Object(fields)) = serde_json::to_value(spec) {
        for (key, value) in fields {
            let value = match value {
                Value::Null => continue,
                Value::String(text) => text,
                other => other.to_string(),
            };
            if key == "preset" {
                preset = Some(value);
            } else {
                refinements.push(format!("{}={value}", key.replace('_', "-")));
            }
        }
    }
    (preset, refinements)
}

/// `gp2`, `gp2 (ceiling-iops=800)`, `custom (baseline-iops=500, burst=none)`.
fn spec_label(spec: &QosSpec) -> String {
    let (preset, refinements) = spec_parts(spec);
    let name = preset.unwrap_or_else(|| "custom".to_string());
    if refinements.is_empty() {
        name
    } else {
        format!("{name} ({})", refinements.join(", "))
    }
}

/// The finite dimensions of a rate (`300 IOPS`, `300 IOPS / 125 MB/s`), or `unlimited`.
fn rate_short(rate: &RateView) -> String {
    match (rate.iops, rate.bytes_per_s) {
        (None, None) => "unlimited".to_string(),
        (Some(iops), None) => format!("{iops} IOPS"),
        (None, Some(bytes)) => bytes_rate(bytes),
        (Some(iops), Some(bytes)) => format!("{iops} IOPS / {}", bytes_rate(bytes)),
    }
}

/// Both dimensions, each `unlimited` when null.
fn rate_full(rate: &RateView) -> String {
    if rate.iops.is_none() && rate.bytes_per_s.is_none() {
        return "unlimited".to_string();
    }
    let iops = rate
        .iops
        .map_or_else(|| "unlimited IOPS".to_string(), |v| format!("{v} IOPS"));
    let bytes = rate
        .bytes_per_s
        .map_or_else(|| "unlimited bytes/s".to_string(), bytes_rate);
    format!("{iops}, {bytes}")
}

/// Bytes per second as MB/s (10^6) when exact, else MiB/s when exact, else MB/s rounded.
pub(crate) fn bytes_rate(bytes_per_s: u64) -> String {
    const MB: u64 = 1_000_000;
    const MIB: u64 = 1 << 20;
    if bytes_per_s.is_multiple_of(MB) {
        format!("{} MB/s", bytes_per_s / MB)
    } else if bytes_per_s.is_multiple_of(MIB) {
        format!("{} MiB/s", bytes_per_s / MIB)
    } else {
        format!("{:.1} MB/s", bytes_per_s as f64 / MB as f64)
    }
}

/// Bytes for people: exact binary units when they divide, else one decimal (`1.5GiB`).
pub(crate) fn human_bytes(bytes: u64) -> String {
    for (unit, name) in crate::size::BINARY_UNITS {
        if bytes >= unit {
            if bytes.is_multiple_of(unit) {
                return format!("{}{name}", bytes / unit);
            }
            return format!("{:.1}{name}", bytes as f64 / unit as f64);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes_and_rates() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(1000), "1000B");
        assert_eq!(human_bytes(1 << 30), "1GiB");
        assert_eq!(human_bytes(3 << 29), "1.5GiB");
        assert_eq!(bytes_rate(125_000_000), "125 MB/s");
        assert_eq!(bytes_rate(250 << 20), "250 MiB/s");
        assert_eq!(bytes_rate(1_500_001), "1.5 MB/s");
    }

    #[test]
    fn no_flag_means_no_spec() {
        assert_eq!(QosArgs::default().spec(), None);
        let args = QosArgs {
            preset: Some("gp2".to_string()),
            ceiling_iops: Some(800),
            ..QosArgs::default()
        };
        let spec = args.spec().expect("a spec");
        assert_eq!(spec_label(&spec), "gp2 (ceiling-iops=800)");
    }
}
