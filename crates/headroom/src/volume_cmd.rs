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
use crate::outln;
use crate::output::{Align, Table, bytes_rate, human_bytes, percent, print_json};
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
        /// Copies of every extent, each on a distinct device (distinct failure domains when
        /// devices declare them): a write completes once it is on every copy. 1 to 3; more
        /// than the pool's healthy devices is refused. Fixed for the volume's life.
        #[arg(long, value_name = "N", default_value_t = 1,
              value_parser = clap::value_parser!(u8).range(1..=3))]
        replicas: u8,
        #[command(flatten)]
        qos: QosArgs,
        /// Print the API's JSON (`VolumeView`) instead of a sentence.
        #[arg(long)]
        json: bool,
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
    /// Verify the checksum of every block of every copy of every allocated extent (repairing
    /// a bad block from a copy that verifies), then compare the copies (64 KiB chunks) and
    /// repair a chunk from the majority when there is one (3 copies); two copies that
    /// disagree are reported only. Synchronous: one read of every copy.
    Scrub {
        name: String,
        /// Print the API's JSON (`{"extents_checked", "mismatches", "repaired",
        /// "blocks_verified", "checksum_mismatches", "checksum_repaired", "unrepairable"}`).
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
        /// Print the API's JSON (`VolumeView`) instead of a sentence.
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
        /// Print the API's JSON (`VolumeView`) instead of a sentence.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Serve a volume as a vhost-user-blk device on a Unix socket (for QEMU's
    /// vhost-user-blk-pci; docs/operations.md). Stored: a restart serves it again.
    Attach {
        name: String,
        /// The socket's path (a stale socket there is replaced; any other file is refused).
        #[arg(long, value_name = "PATH")]
        vhost_user: String,
        /// Virtqueues offered, 1 to 16 (QEMU's `num-queues` may not exceed it).
        #[arg(long, default_value_t = 1)]
        num_queues: u16,
        /// The socket file's permission bits, in octal (e.g. 0660); default: the umask's.
        #[arg(long, value_parser = parse_mode)]
        mode: Option<u32>,
        /// The socket file's owner and group (numbers); default: the server's.
        #[arg(long)]
        uid: Option<u32>,
        #[arg(long)]
        gid: Option<u32>,
        /// Adaptive polling: the longest each queue keeps looking at its ring after
        /// draining it before asking for kicks again, µs (0 to 1000; default 0: event mode).
        #[arg(long)]
        poll_us: Option<u32>,
        /// Print the API's JSON (the volume's attachments) instead of a sentence.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Stop serving a volume on a vhost-user socket: its frontend is disconnected and the
    /// socket removed.
    Detach {
        name: String,
        #[arg(long, value_name = "PATH")]
        vhost_user: String,
        /// Print `{"detached": NAME, "vhost_user": PATH}` instead of a sentence.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Delete a volume and free its space.
    Delete {
        name: String,
        /// Print `{"deleted": NAME}` instead of a sentence.
        #[arg(long)]
        json: bool,
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

/// Runs a volume command; errors go back to `main`, which maps them to exit codes.
pub fn run(command: VolumeCommand) -> Result<()> {
    match command {
        VolumeCommand::Create {
            name,
            size,
            tenant,
            read_only,
            replicas,
            qos,
            json,
            api,
        } => {
            let body = CreateVolume {
                name,
                size_bytes: size,
                qos: qos.spec(),
                tenant,
                read_only,
                replicas: (replicas != 1).then_some(replicas),
            };
            let view = api.client()?.create(&body)?;
            if json {
                return print_json(&view);
            }
            let mut access = String::new();
            if let Some(tenant) = &view.info.tenant {
                access.push_str(&format!(", tenant {tenant}"));
            }
            if view.info.read_only {
                access.push_str(", read-only");
            }
            if view.info.replicas > 1 {
                access.push_str(&format!(", {} replicas", view.info.replicas));
            }
            outln!(
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
                print_json(&api.list_json(tenant)?)?;
            } else {
                print_list(&api.list(tenant)?);
            }
        }
        VolumeCommand::Show { name, json, api } => {
            let api = api.client()?;
            if json {
                print_json(&api.show_json(&name)?)?;
            } else {
                print_volume(&api.show(&name)?);
            }
        }
        VolumeCommand::Scrub { name, json, api } => {
            let report = api.client()?.scrub(&name)?;
            if json {
                return print_json(&report);
            }
            let n = |k: &str| {
                report
                    .get(k)
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0)
            };
            outln!(
                "{name}: {} extents checked, {} chunks differed, {} repaired; {} blocks \
                 verified, {} failed their checksum, {} of them repaired, {} unrepairable",
                n("extents_checked"),
                n("mismatches"),
                n("repaired"),
                n("blocks_verified"),
                n("checksum_mismatches"),
                n("checksum_repaired"),
                n("unrepairable")
            );
        }
        VolumeCommand::Qos {
            name,
            qos,
            json,
            api,
        } => {
            let api = api.client()?;
            let view = match qos.spec() {
                Some(change) => api.set_qos(&name, change)?,
                None => api.show(&name)?,
            };
            if json {
                return print_json(&view);
            }
            outln!(
                "{}: {}",
                view.info.name,
                qos_summary(view.qos_class.as_ref(), &view.credits)
            );
        }
        VolumeCommand::Resize {
            name,
            size,
            json,
            api,
        } => {
            let view = api.client()?.resize(&name, size)?;
            if json {
                return print_json(&view);
            }
            outln!(
                "resized {} to {}",
                view.info.name,
                format_size(view.info.size_bytes)
            );
        }
        VolumeCommand::Attach {
            name,
            vhost_user,
            num_queues,
            mode,
            uid,
            gid,
            poll_us,
            json,
            api,
        } => {
            let body = serde_json::json!({
                "vhost_user": vhost_user,
                "num_queues": num_queues,
                "mode": mode,
                "uid": uid,
                "gid": gid,
                "poll_us": poll_us,
            });
            let answer = api.client()?.attach(&name, &body)?;
            if json {
                return print_json(&answer);
            }
            outln!("attached {name} at {vhost_user} (vhost-user-blk, {num_queues} queues)");
        }
        VolumeCommand::Detach {
            name,
            vhost_user,
            json,
            api,
        } => {
            api.client()?.detach(&name, &vhost_user)?;
            if json {
                return print_json(
                    &serde_json::json!({ "detached": name, "vhost_user": vhost_user }),
                );
            }
            outln!("detached {name} from {vhost_user}");
        }
        VolumeCommand::Delete { name, json, api } => {
            api.client()?.delete(&name)?;
            if json {
                return print_json(&serde_json::json!({ "deleted": name }));
            }
            outln!("deleted {name}");
        }
    }
    Ok(())
}

/// Permission bits in octal (`0660`, `660` or `0o660`), at most `0o777`.
fn parse_mode(text: &str) -> std::result::Result<u32, String> {
    let digits = text.trim_start_matches("0o");
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(format!("{text:?}: permission bits in octal, at most 0777")),
    }
}

fn print_list(volumes: &[VolumeView]) {
    // QOS last: a QEMU preset spelled out is long.
    let mut table = Table::new(&[
        ("NAME", Align::Left),
        ("TENANT", Align::Left),
        ("ACCESS", Align::Left),
        ("REPLICAS", Align::Right),
        ("HEALTH", Align::Left),
        ("SIZE", Align::Right),
        ("ALLOCATED", Align::Right),
        ("CREDITS", Align::Right),
        ("QOS", Align::Left),
    ]);
    for view in volumes {
        table.row(vec![
            view.info.name.clone(),
            view.info.tenant.clone().unwrap_or_else(|| "-".to_string()),
            access_column(view.info.read_only).to_string(),
            view.info.replicas.to_string(),
            view.info.health.clone(),
            format_size(view.info.size_bytes),
            human_bytes(view.info.allocated_bytes),
            credits_column(&view.credits),
            qos_column(view.qos_class.as_ref()),
        ]);
    }
    table.print();
    if volumes.is_empty() {
        // On stderr: stdout stays the table alone, for scripts that read it.
        eprintln!("no volumes yet: create one with `headroom volume create NAME --size 10GiB`");
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
    use std::fmt::Write as _;
    let info = &view.info;
    let mut text = String::new();
    // Writing to a String cannot fail.
    let mut line = |args: std::fmt::Arguments| {
        let _ = text.write_fmt(args);
        text.push('\n');
    };
    line(format_args!("name:        {}", info.name));
    line(format_args!("id:          {}", info.id));
    line(format_args!(
        "size:        {} ({} bytes)",
        format_size(info.size_bytes),
        info.size_bytes
    ));
    line(format_args!(
        "allocated:   {} ({} bytes, {} of the size)",
        human_bytes(info.allocated_bytes),
        info.allocated_bytes,
        percent(info.allocated_bytes, info.size_bytes)
    ));
    line(format_args!(
        "created:     {} UTC",
        crate::calibrate::utc(info.created_unix_s)
    ));
    match &info.tenant {
        Some(tenant) => line(format_args!("tenant:      {tenant}")),
        None => line(format_args!(
            "tenant:      - (served to NBD clients without a TLS identity)"
        )),
    }
    line(format_args!(
        "access:      {}",
        if info.read_only {
            "read-only"
        } else {
            "read-write"
        }
    ));
    line(format_args!(
        "replicas:    {} ({})",
        info.replicas, info.health
    ));
    if let Some(r) = &view.rebuild {
        line(format_args!(
            "rebuild:     {} ({}/{} extents, {}/s){}",
            r.state,
            r.extents_done,
            r.extents_total,
            crate::output::human_bytes(r.bytes_per_s),
            r.reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        ));
    }
    line(format_args!("policy:      {}", view.policy));
    match &view.qos_class {
        None => line(format_args!(
            "qos:         unlimited (no baseline promise, no ceiling)"
        )),
        Some(qos) => {
            line(format_args!("qos:         {}", spec_label(&qos.spec)));
            line(format_args!("  baseline:  {}", rate_full(&qos.baseline)));
            line(format_args!("  ceiling:   {}", rate_full(&qos.ceiling)));
            line(format_args!("  burst:     {}", qos.burst));
            line(format_args!("  weight:    {}", qos.weight));
            if qos.io_unit_bytes > 0 {
                line(format_args!(
                    "  io unit:   {} (larger requests count as several I/Os)",
                    human_bytes(u64::from(qos.io_unit_bytes))
                ));
            }
            if let Some(bucket) = &qos.iops_bucket {
                line(format_args!(
                    "  iops bucket:  {} credits, refill {}/s",
                    bucket.capacity, bucket.refill_per_s
                ));
            }
            if let Some(bucket) = &qos.bytes_bucket {
                line(format_args!(
                    "  bytes bucket: {}, refill {}/s",
                    human_bytes(bucket.capacity),
                    human_bytes(bucket.refill_per_s)
                ));
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
    line(format_args!("credits:     {}", credits.join(", ")));
    line(format_args!(
        "queued:      {} requests",
        view.queued_requests
    ));
    text.push('\n');

    let mut table = Table::new(&[
        ("PHASE", Align::Left),
        ("I/OS", Align::Right),
        ("BYTES", Align::Right),
        ("TIME (S)", Align::Right),
        ("MEAN (µS/I/O)", Align::Right),
    ]);
    let phases = &view.phases;
    for (label, phase) in [
        ("baseline", &phases.baseline),
        ("burst on credits", &phases.burst_credit),
        ("burst on spare capacity", &phases.burst_spare),
    ] {
        table.row(phase_row(
            label,
            phase.ios,
            Some(phase.bytes),
            phase.time_ns,
        ));
    }
    table.row(phase_row(
        "throttled (waiting)",
        phases.throttled.ios,
        None,
        phases.throttled.time_ns,
    ));
    text.push_str(&table.render(crate::output::stdout_styled()));
    let audit = &view.audit;
    text.push_str(&format!(
        "\npromise audit ({} seconds judged since the node started):\n",
        audit.seconds_judged
    ));
    text.push_str(&format!(
        "  short:     {} s below baseline while asking for it (node's fault), short by {} I/Os, {}\n",
        audit.short_seconds,
        audit.shortfall_ops,
        human_bytes(audit.shortfall_bytes)
    ));
    text.push_str(&format!(
        "  own limit: {} s held at its own ceiling or empty credits\n",
        audit.own_limit_seconds
    ));
    crate::output::emit(&text);
}

fn phase_row(label: &str, ios: u64, bytes: Option<u64>, time_ns: u64) -> Vec<String> {
    let mean = if ios == 0 {
        "-".to_string()
    } else {
        format!("{:.1}", time_ns as f64 / ios as f64 / 1e3)
    };
    vec![
        label.to_string(),
        ios.to_string(),
        bytes.map_or_else(|| "-".to_string(), human_bytes),
        format!("{:.3}", time_ns as f64 / 1e9),
        mean,
    ]
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

#[cfg(test)]
mod tests {
    use super::*;

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
