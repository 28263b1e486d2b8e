//! `headroom pool`: the pool's capacity and how much of it volumes use, per device, from
//! `GET /v1/pool`. Read as loose JSON on purpose: fields a newer server adds (provisioned
//! bytes, overcommit ratio) are shown when present, and an older server without them still
//! gets a table.

use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value;

use crate::client::ApiArgs;
use crate::output::{Align, Fields, Table, emit, human_bytes, percent, print_json};

#[derive(Args, Debug)]
pub struct PoolArgs {
    /// Print the API's JSON (`GET /v1/pool`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

pub fn run(args: PoolArgs) -> Result<()> {
    let pool = args.api.client()?.pool_json()?;
    if args.json {
        return print_json(&pool);
    }
    emit(&render(&pool)?);
    Ok(())
}

fn u64_field(value: &Value, key: &str) -> Option<u64> {
    value.get(key).and_then(Value::as_u64)
}

/// The summary and the device table, for people.
fn render(pool: &Value) -> Result<String> {
    let need = |key: &str| {
        u64_field(pool, key).with_context(|| {
            format!("reading the API's pool: no `{key}` (is the server the same version?)")
        })
    };
    let capacity = need("capacity_bytes")?;
    let free = need("free_bytes")?;
    let extent = need("extent_size_bytes")?;
    let allocated = need("allocated_extents")?.saturating_mul(extent);
    let devices = pool
        .get("devices")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);

    let mut fields = Fields::new();
    fields.add(
        "capacity",
        format!("{} on {} device(s)", human_bytes(capacity), devices.len()),
    );
    fields.add(
        "allocated",
        format!(
            "{} ({} of the capacity)",
            human_bytes(allocated),
            percent(allocated, capacity)
        ),
    );
    fields.add("free", human_bytes(free));
    // Added by a newer server: the volumes' sizes summed, and that over the capacity.
    if let Some(provisioned) = u64_field(pool, "provisioned_bytes") {
        let ratio = pool
            .get("overcommit_ratio")
            .and_then(Value::as_f64)
            .or_else(|| (capacity > 0).then(|| provisioned as f64 / capacity as f64));
        let ratio = ratio.map_or_else(String::new, |r| format!(", overcommit {r:.2}x"));
        fields.add(
            "provisioned",
            format!("{} (volume sizes summed{ratio})", human_bytes(provisioned)),
        );
    } else if let Some(ratio) = pool.get("overcommit_ratio").and_then(Value::as_f64) {
        fields.add("overcommit", format!("{ratio:.2}x"));
    }
    fields.add("extent size", human_bytes(extent));
    let quarantined = u64_field(pool, "quarantined_extents").unwrap_or(0);
    if quarantined > 0 {
        fields.add(
            "quarantined",
            format!("{quarantined} extent(s), reusable after the next metadata commit"),
        );
    }
    let leaked = u64_field(pool, "leaked_extents").unwrap_or(0);
    if leaked > 0 {
        fields.add(
            "leaked",
            format!("{leaked} extent(s) whose punch failed, reusable after a restart"),
        );
    }

    let mut table = Table::new(&[
        ("DEVICE", Align::Right),
        ("CAPACITY", Align::Right),
        ("ALLOCATED", Align::Right),
        ("USE%", Align::Right),
        ("ON DISK", Align::Right),
        ("STATE", Align::Left),
        ("PATH", Align::Left),
    ]);
    for device in devices {
        let capacity = u64_field(device, "capacity_bytes").unwrap_or(0);
        let extents = u64_field(device, "extent_count").unwrap_or(0);
        let free_extents = u64_field(device, "free_extents").unwrap_or(0);
        // Newer servers say it (quarantined and leaked extents included); else from extents.
        let allocated = u64_field(device, "allocated_bytes")
            .unwrap_or_else(|| extents.saturating_sub(free_extents).saturating_mul(extent));
        let failed = device
            .get("failed")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        table.row(vec![
            u64_field(device, "id").map_or_else(|| "?".to_string(), |id| id.to_string()),
            human_bytes(capacity),
            human_bytes(allocated),
            percent(allocated, capacity),
            u64_field(device, "physical_used_bytes").map_or_else(|| "-".to_string(), human_bytes),
            if failed { "FAILED" } else { "ok" }.to_string(),
            device
                .get("path")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
        ]);
    }
    let mut text = fields.render();
    text.push('\n');
    text.push_str(&table.render(crate::output::stdout_styled()));
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_summary_and_optional_fields() {
        let mut pool = serde_json::json!({
            "extent_size_bytes": 1 << 20,
            "capacity_bytes": 4u64 << 30,
            "free_bytes": 3u64 << 30,
            "total_extents": 4096,
            "free_extents": 3072,
            "allocated_extents": 1024,
            "quarantined_extents": 0,
            "leaked_extents": 0,
            "devices": [
                {"id": 0, "path": "/d/dev-0.img", "capacity_bytes": 2u64 << 30,
                 "extent_count": 2048, "free_extents": 1024, "physical_used_bytes": 4096},
                {"id": 1, "path": "/dev/sdb", "capacity_bytes": 2u64 << 30,
                 "extent_count": 2048, "free_extents": 2048, "physical_used_bytes": null,
                 "failed": true}
            ]
        });
        let text = render(&pool).unwrap();
        assert!(text.contains("capacity:     4GiB on 2 device(s)"), "{text}");
        assert!(text.contains("1GiB (25.0% of the capacity)"), "{text}");
        assert!(!text.contains("provisioned"), "{text}");
        let row = |device: &str| {
            text.lines()
                .find(|l| l.split_whitespace().next() == Some(device))
                .map(|l| l.split_whitespace().collect::<Vec<_>>())
                .unwrap()
        };
        assert_eq!(
            row("0"),
            ["0", "2GiB", "1GiB", "50.0%", "4KiB", "ok", "/d/dev-0.img"]
        );
        assert_eq!(
            row("1"),
            ["1", "2GiB", "0B", "0.0%", "-", "FAILED", "/dev/sdb"]
        );

        pool["provisioned_bytes"] = serde_json::json!(10u64 << 30);
        let text = render(&pool).unwrap();
        assert!(
            text.contains("10GiB (volume sizes summed, overcommit 2.50x)"),
            "{text}"
        );
        pool["overcommit_ratio"] = serde_json::json!(3.0);
        assert!(render(&pool).unwrap().contains("overcommit 3.00x"));
        // A server that reports each device's allocation is believed.
        pool["devices"][1]["allocated_bytes"] = serde_json::json!(1u64 << 30);
        let text = render(&pool).unwrap();
        assert!(
            text.lines().any(|l| l
                .split_whitespace()
                .take(4)
                .eq(["1", "2GiB", "1GiB", "50.0%"])),
            "{text}"
        );
        assert!(render(&serde_json::json!({})).is_err());
    }
}
