//! `headroom rebuild show|set`: the node's rebuild of lost copies after a device failure
//! (`GET`/`PUT /v1/rebuild`). A command of its own because the rebuild is the node's, not a
//! volume's: one rate for every volume's rebuild, changed live. Read as loose JSON, like
//! `device`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::client::ApiArgs;
use crate::outln;
use crate::output::{human_bytes, print_json};
use crate::size::parse_size;

#[derive(Subcommand, Debug)]
pub enum RebuildCommand {
    /// The rebuild's rate, bytes copied, extents remaining and each volume's progress.
    Show(RebuildShowArgs),
    /// Change the rebuild's rate live: the running copy follows from its next 2 MiB extent.
    Set(SetRateArgs),
}

#[derive(Args, Debug)]
pub struct RebuildShowArgs {
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

/// `set --rate RATE`: a background task's rate (the rebuild's, the scrub's), changed live.
#[derive(Args, Debug)]
pub struct SetRateArgs {
    /// Bytes per second: 64MiB (binary), 100MB (decimal), or bytes.
    #[arg(long, value_parser = parse_size)]
    pub rate: u64,
    /// Print the API's JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub api: ApiArgs,
}

pub fn run(command: RebuildCommand) -> Result<()> {
    let (view, json) = match command {
        RebuildCommand::Show(args) => (args.api.client()?.get_json("/v1/rebuild")?, args.json),
        RebuildCommand::Set(args) => (args.api.client()?.set_rebuild_rate(args.rate)?, args.json),
    };
    if json {
        return print_json(&view);
    }
    let n = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    outln!(
        "rebuild rate {}/s, {} copied, {} extents remaining",
        human_bytes(n(&view, "rate_bytes_per_s")),
        human_bytes(n(&view, "bytes_total")),
        n(&view, "extents_remaining")
    );
    for v in view
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        outln!(
            "  {}: {} ({}/{} extents, {}/s){}",
            v.get("volume").and_then(Value::as_str).unwrap_or("?"),
            v.get("state").and_then(Value::as_str).unwrap_or("?"),
            n(v, "extents_done"),
            n(v, "extents_total"),
            human_bytes(n(v, "bytes_per_s")),
            v.get("reason")
                .and_then(Value::as_str)
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
