//! `headroom arbitration`: cross-node arbitration of the shared RADOS pool as a running
//! node sees it (`GET /v1/arbitration`): the epoch, the arbiter, this node's demand and share,
//! and the newest split of all nodes.

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use crate::client::ApiArgs;
use crate::output::{Align, Fields, Table, emit, print_json};

#[derive(Args, Debug)]
pub struct ArbitrationArgs {
    /// Print the API's JSON (`GET /v1/arbitration`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

pub fn run(args: ArbitrationArgs) -> Result<()> {
    let status = args.api.client()?.get_json("/v1/arbitration")?;
    if args.json {
        return print_json(&status);
    }
    emit(&render(&status));
    Ok(())
}

fn u64_of(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// Device units per second as operations per second (1000 units per operation).
fn ops(units: u64) -> String {
    format!("{} IOPS", units / 1000)
}

fn render(s: &Value) -> String {
    if s.get("enabled").and_then(Value::as_bool) != Some(true) {
        return "arbitration is off on this node (serve --rados-arbitration)\n".into();
    }
    let text = |key: &str| {
        s.get(key)
            .and_then(Value::as_str)
            .unwrap_or("-")
            .to_string()
    };
    let mut fields = Fields::new();
    fields.add(
        "node",
        format!("{} (weight {})", text("node_id"), u64_of(s, "weight")),
    );
    fields.add(
        "epoch",
        format!(
            "{} (every {} ms)",
            u64_of(s, "epoch"),
            u64_of(s, "epoch_ms")
        ),
    );
    let me = s.get("is_arbiter").and_then(Value::as_bool) == Some(true);
    fields.add(
        "arbiter",
        format!(
            "{}{}",
            text("arbiter"),
            if me { " (this node)" } else { "" }
        ),
    );
    fields.add("capacity", ops(u64_of(s, "capacity_units_per_s")));
    fields.add(
        "share",
        format!(
            "{}{}",
            ops(u64_of(s, "share_units_per_s")),
            if s.get("fallback").and_then(Value::as_bool) == Some(true) {
                " (fallback: no recent split)"
            } else {
                ""
            }
        ),
    );
    fields.add(
        "demand",
        format!(
            "{} reserved, {} total",
            ops(u64_of(s, "reserved_units_per_s")),
            ops(u64_of(s, "demand_units_per_s"))
        ),
    );
    if let Some(err) = s.get("last_error").and_then(Value::as_str) {
        fields.add("last error", err);
    }
    let mut table = Table::new(&[
        ("NODE", Align::Left),
        ("WEIGHT", Align::Right),
        ("RESERVED", Align::Right),
        ("DEMAND", Align::Right),
        ("SHARE", Align::Right),
    ]);
    for n in s
        .get("nodes")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
    {
        table.row(vec![
            n.get("node_id")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            u64_of(n, "weight").to_string(),
            ops(u64_of(n, "reserved_units_per_s")),
            ops(u64_of(n, "demand_units_per_s")),
            ops(u64_of(n, "share_units_per_s")),
        ]);
    }
    let mut out = fields.render();
    out.push('\n');
    out.push_str(&table.render(crate::output::stdout_styled()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_the_arbiter_the_share_and_every_node() {
        let s = serde_json::json!({
            "enabled": true, "node_id": "a", "weight": 1, "epoch_ms": 500, "epoch": 42,
            "is_arbiter": true, "arbiter": "a", "capacity_units_per_s": 10_000_000,
            "share_units_per_s": 6_000_000, "reserved_units_per_s": 1_000_000,
            "demand_units_per_s": 10_000_000, "fallback": false,
            "nodes": [
                {"node_id": "a", "weight": 1, "reserved_units_per_s": 1_000_000,
                 "demand_units_per_s": 10_000_000, "share_units_per_s": 6_000_000},
                {"node_id": "b", "weight": 1, "reserved_units_per_s": 3_000_000,
                 "demand_units_per_s": 4_000_000, "share_units_per_s": 4_000_000}
            ]
        });
        let out = render(&s);
        assert!(out.contains("a (this node)"), "{out}");
        assert!(out.contains("6000 IOPS"), "{out}");
        assert!(out.contains("42 (every 500 ms)"), "{out}");
        assert!(
            out.lines()
                .any(|l| l.starts_with('b') && l.contains("4000 IOPS")),
            "{out}"
        );
        let off = render(&serde_json::json!({"enabled": false}));
        assert!(off.contains("arbitration is off"), "{off}");
    }
}
