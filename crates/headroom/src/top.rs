//! `headroom top`: the node's volumes live in a terminal, busiest first, refreshed every second
//! from `GET /v1/stats` (the same numbers as the dashboard).
//!
//! Plain text and a few ANSI sequences (clear, bold) instead of a TUI crate: the view is one
//! table redrawn whole each second, so there is nothing a widget library would add. Escapes are
//! only written to a terminal: `--once` into a pipe prints plain text for scripts, and `--json`
//! prints the API's document (one line per refresh).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use headroom_node::timeline::{Dimensions, StatsReport, VolumeSample};

use crate::client::{Api, ApiArgs};
use crate::output::{emit, grouped};

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Print one frame and exit (for scripts and tests).
    #[arg(long)]
    once: bool,
    /// Print the API's JSON (`GET /v1/stats?seconds=1`), one document per line and refresh.
    #[arg(long)]
    json: bool,
    /// Volumes shown at most (busiest first; a terminal shows what fits) [1-10000].
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    limit: u64,
    #[command(flatten)]
    api: ApiArgs,
}

/// `top`'s one HTTP call: `GET /v1/stats?seconds=1&limit=N` through the CLI's client (its
/// token lookup and typed errors, so a refusal or an unreachable server exits 5 or 4).
fn fetch_stats(client: &Api, limit: u64) -> Result<serde_json::Value> {
    client.get_json(&format!("/v1/stats?seconds=1&limit={limit}"))
}

pub fn run(args: TopArgs) -> Result<()> {
    execute(&args)
}

fn execute(args: &TopArgs) -> Result<()> {
    let terminal = std::io::stdout().is_terminal();
    let live = !args.once;
    let client = args.api.client()?;
    loop {
        let started = Instant::now();
        let body = fetch_stats(&client, args.limit)?;
        if args.json {
            // One compact line per refresh.
            emit(&format!("{body}\n"));
        } else {
            let report: StatsReport = serde_json::from_value(body)
                .context("reading the API's answer (is the server the same version?)")?;
            let size = if live && terminal {
                terminal_size()
            } else {
                None
            };
            let mut frame = render(&report, &args.api.url, size.map(|(rows, _)| rows), terminal);
            if let Some((_, cols)) = size {
                frame = fit_width(&frame, cols);
            }
            if live && terminal {
                // Home and clear, then the frame: one write, so it does not flicker.
                emit(&format!("\x1b[H\x1b[2J{frame}"));
            } else if live {
                emit(&format!("{frame}\n"));
            } else {
                emit(&frame);
            }
        }
        if !live {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1).saturating_sub(started.elapsed()));
    }
}

/// The terminal's size (rows, columns), when stdout is one.
fn terminal_size() -> Option<(usize, usize)> {
    rustix::termios::tcgetwinsize(std::io::stdout())
        .ok()
        .map(|size| (usize::from(size.ws_row), usize::from(size.ws_col)))
        .filter(|(rows, cols)| *rows > 0 && *cols > 0)
}

/// Cuts every line without escapes to `cols` characters (a wrapped line would scroll the
/// frame).
fn fit_width(frame: &str, cols: usize) -> String {
    let mut out = String::with_capacity(frame.len());
    for line in frame.lines() {
        if line.contains('\x1b') || line.chars().count() <= cols {
            out.push_str(line);
        } else {
            out.extend(line.chars().take(cols.saturating_sub(1)));
            out.push('>');
        }
        out.push('\n');
    }
    out
}

/// At most `max` names of a list, then how many more.
fn first_few(items: Vec<String>, max: usize) -> String {
    if items.is_empty() {
        return "none".to_string();
    }
    let more = items.len().saturating_sub(max);
    let mut text = items.into_iter().take(max).collect::<Vec<_>>().join(", ");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

fn thousands(value: f64) -> String {
    grouped(value.round().max(0.0) as u64)
}

fn opt<T>(value: Option<T>, show: impl Fn(T) -> String) -> String {
    value.map_or_else(|| "-".to_string(), show)
}

fn mbps(bytes_per_s: f64) -> String {
    format!("{:.1}", bytes_per_s / 1e6)
}

fn latency(us: f64) -> String {
    if us >= 1000.0 {
        format!("{:.2}ms", us / 1000.0)
    } else {
        format!("{us:.0}us")
    }
}

fn phase(volume: &VolumeSample) -> &'static str {
    let Some(phases) = volume.phase_iops else {
        return "-";
    };
    if volume.bursting {
        match (phases.burst_credit > 0.0, phases.burst_spare > 0.0) {
            (true, true) => "burst-both",
            (false, true) => "burst-spare",
            _ => "burst-credit",
        }
    } else if volume.queue_depth.unwrap_or(0) > 0 {
        "throttled"
    } else if volume.iops.unwrap_or(0.0) > 0.0 {
        "baseline"
    } else {
        "idle"
    }
}

fn baseline(volume: &VolumeSample) -> String {
    let mut parts = Vec::new();
    if let Some(iops) = volume.baseline.iops.filter(|v| *v > 0) {
        parts.push(format!("{} IOPS", thousands(iops as f64)));
    }
    if let Some(bytes) = volume.baseline.bytes_per_s.filter(|v| *v > 0) {
        parts.push(format!("{} MB/s", mbps(bytes as f64)));
    }
    if !parts.is_empty() {
        parts.join(", ")
    } else if volume.baseline.iops.is_none() && volume.baseline.bytes_per_s.is_none() {
        "unlimited".to_string()
    } else {
        "none".to_string()
    }
}

fn utilisation_line(report: &StatsReport) -> String {
    let last = report.samples.last();
    let dims: Dimensions<Option<f64>> = last.map(|s| s.node.utilisation).unwrap_or_default();
    let caps = report.capacity_per_second;
    let show = |name: &str, value: Option<f64>, cap: Option<u64>| {
        let text = match (report.scheduler, cap, value) {
            (false, _, _) => "-".to_string(),
            (true, None, _) => "unlimited".to_string(),
            (true, Some(_), Some(v)) => format!("{:.1}%", v * 100.0),
            (true, Some(_), None) => "-".to_string(),
        };
        format!("{name} {text}")
    };
    let mut line = [
        show("cpu", dims.cpu_ns, caps.cpu_ns),
        show("ingress", dims.ingress_bytes, caps.ingress_bytes),
        show("egress", dims.egress_bytes, caps.egress_bytes),
        show("device", dims.device_units, caps.device_units),
    ]
    .join("  ");
    if let Some(sample) = last {
        line.push_str(&format!(
            "  | {} IOPS  {} MB/s  {}/{} volumes active",
            opt(sample.node.iops, thousands),
            opt(sample.node.bytes_per_s, mbps),
            sample.volumes_active,
            report.volumes_tracked
        ));
    }
    format!("node  {line}")
}

/// One frame: title, node line, the table, who bursts and who lends.
fn render(report: &StatsReport, api: &str, height: Option<usize>, ansi: bool) -> String {
    let (bold, reset) = if ansi {
        ("\x1b[1m", "\x1b[0m")
    } else {
        ("", "")
    };
    let mut out = String::new();
    let time = report.samples.last().map_or_else(
        || "waiting for the first sample".to_string(),
        |s| {
            let day_s = (s.unix_ms / 1000) % 86_400;
            format!(
                "{:02}:{:02}:{:02} UTC",
                day_s / 3600,
                day_s / 60 % 60,
                day_s % 60
            )
        },
    );
    out.push_str(&format!(
        "{bold}headroom top{reset}  {api}  policy {}  {time}\n",
        report.policy
    ));
    out.push_str(&utilisation_line(report));
    out.push('\n');
    if let Some(note) = &report.note {
        out.push_str(&format!("note: {note}\n"));
    }
    out.push('\n');
    let header = [
        "VOLUME", "TENANT", "IOPS", "MB/s", "LATENCY", "QUEUE", "CREDITS", "PHASE", "BASELINE",
    ];
    let rows: Vec<[String; 9]> = report
        .volumes
        .iter()
        .map(|v| {
            [
                v.name.clone(),
                v.tenant.clone().unwrap_or_else(|| "-".to_string()),
                opt(v.iops, thousands),
                opt(v.bytes_per_s, mbps),
                opt(v.latency_us_mean, latency),
                opt(v.queue_depth, |q| thousands(q as f64)),
                opt(v.credits.and_then(|c| c.iops), |c| thousands(c as f64)),
                phase(v).to_string(),
                baseline(v),
            ]
        })
        .collect();
    // Room for the table: the terminal minus the lines around it.
    let shown = height.map_or(rows.len(), |h| h.saturating_sub(9).max(1).min(rows.len()));
    let mut widths: [usize; 9] = header.map(str::len);
    for row in rows.iter().take(shown) {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    // Names and tenants left-aligned, numbers right-aligned, phase and baseline left.
    let right = [false, false, true, true, true, true, true, false, false];
    let line = |cells: &[String; 9]| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i].saturating_sub(cell.chars().count());
            if right[i] {
                text.push_str(&" ".repeat(pad));
                text.push_str(cell);
            } else {
                text.push_str(cell);
                if i + 1 < cells.len() {
                    text.push_str(&" ".repeat(pad));
                }
            }
            if i + 1 < cells.len() {
                text.push_str("  ");
            }
        }
        text.trim_end().to_string()
    };
    out.push_str(&format!(
        "{bold}{}{reset}\n",
        line(&header.map(String::from))
    ));
    for row in rows.iter().take(shown) {
        out.push_str(&line(row));
        out.push('\n');
    }
    if shown < report.volumes_tracked {
        out.push_str(&format!(
            "... {} more volumes\n",
            report.volumes_tracked - shown
        ));
    }
    out.push('\n');
    let bursting: Vec<String> = report
        .bursting
        .iter()
        .map(|b| {
            let mut parts = Vec::new();
            if b.burst_credit_iops > 0.0 {
                parts.push(format!(
                    "{} IOPS on credits",
                    thousands(b.burst_credit_iops)
                ));
            }
            if b.burst_spare_iops > 0.0 {
                parts.push(format!("{} IOPS on spare", thousands(b.burst_spare_iops)));
            }
            format!("{} ({})", b.name, parts.join(", "))
        })
        .collect();
    out.push_str(&format!("bursting: {}\n", first_few(bursting, 5)));
    let lending: Vec<String> = report
        .lending
        .iter()
        .map(|l| {
            let mut parts = Vec::new();
            if let Some(iops) = l.lending.unused_iops.filter(|v| *v > 0.0) {
                parts.push(format!("{} IOPS", thousands(iops)));
            }
            if let Some(bytes) = l.lending.unused_bytes_per_s.filter(|v| *v > 0.0) {
                parts.push(format!("{} MB/s", mbps(bytes)));
            }
            format!("{} ({} unused)", l.name, parts.join(", "))
        })
        .collect();
    let spare = &report.spare;
    let total = match (
        spare.lending_volumes,
        spare.unused_baseline_bytes_per_s > 0.0,
    ) {
        (0, _) => String::new(),
        (_, false) => format!("; in all {} IOPS", thousands(spare.unused_baseline_iops)),
        (_, true) => format!(
            "; in all {} IOPS, {} MB/s",
            thousands(spare.unused_baseline_iops),
            mbps(spare.unused_baseline_bytes_per_s)
        ),
    };
    out.push_str(&format!("lending:  {}{total}\n", first_few(lending, 5)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lines_are_cut_to_the_terminal() {
        let frame = "short\nabcdefghij\n\x1b[1mbold header that is long\x1b[0m\n";
        assert_eq!(
            fit_width(frame, 6),
            "short\nabcde>\n\x1b[1mbold header that is long\x1b[0m\n"
        );
        let names = (0..7).map(|i| format!("v{i}")).collect();
        assert_eq!(first_few(names, 5), "v0, v1, v2, v3, v4 and 2 more");
        assert_eq!(first_few(Vec::new(), 5), "none");
    }

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_000.0), "1,000");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }
}
