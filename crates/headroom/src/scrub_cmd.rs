//! `headroom scrub show|start|set`: the node's background scrub, which reads every allocated
//! block below the page cache, verifies it against its checksum and repairs it from a good
//! copy (`GET`/`POST`/`PUT /v1/scrub`). A command of its own because the scrub is the
//! node's, not a volume's (`headroom volume scrub NAME` scrubs one volume now). Read as loose
//! JSON, like `rebuild`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::client::ApiArgs;
use crate::outln;
use crate::output::{human_bytes, print_json};
use crate::rebuild_cmd::SetRateArgs;

#[derive(Subcommand, Debug)]
pub enum ScrubCommand {
    /// The scrub's rate and schedule, the running (or last) pass, and what it found.
    Show(ScrubShowArgs),
    /// Start a pass over every volume now (nothing changes while one runs).
    Start(ScrubShowArgs),
    /// Change the scrub's rate live: a running pass follows from its next 2 MiB extent.
    Set(SetRateArgs),
}

#[derive(Args, Debug)]
pub struct ScrubShowArgs {
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    api: ApiArgs,
}

pub fn run(command: ScrubCommand) -> Result<()> {
    let (view, json) = match command {
        ScrubCommand::Show(args) => (args.api.client()?.get_json("/v1/scrub")?, args.json),
        ScrubCommand::Start(args) => (args.api.client()?.start_scrub()?, args.json),
        ScrubCommand::Set(args) => (args.api.client()?.set_scrub_rate(args.rate)?, args.json),
    };
    if json {
        return print_json(&view);
    }
    let n = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let interval = match n(&view, "interval_s") {
        0 => "on demand only".to_string(),
        s => format!("a pass every {s} s"),
    };
    outln!(
        "scrub {}: rate {}/s, {interval}, {} passes done",
        view.get("state").and_then(Value::as_str).unwrap_or("?"),
        human_bytes(n(&view, "rate_bytes_per_s")),
        n(&view, "passes_done")
    );
    let found = |v: &Value| {
        format!(
            "{} blocks verified, {} failed their checksum ({} repaired, {} unrepairable), {} \
             copy mismatches ({} repaired)",
            n(v, "blocks_verified"),
            n(v, "checksum_mismatches"),
            n(v, "checksum_repaired"),
            n(v, "unrepairable"),
            n(v, "copy_mismatches"),
            n(v, "copies_repaired")
        )
    };
    if let Some(pass) = view.get("pass") {
        let state = if pass.get("finished_unix_s").is_some() {
            "last pass"
        } else {
            "this pass"
        };
        outln!(
            "  {state}: {}/{} volumes, {} extents, {}/s; {}",
            n(pass, "volumes_done"),
            n(pass, "volumes_total"),
            n(pass, "extents_done"),
            human_bytes(n(pass, "bytes_per_s")),
            found(pass.get("found").unwrap_or(&Value::Null))
        );
    }
    outln!(
        "  since the node started: {}",
        found(view.get("totals").unwrap_or(&Value::Null))
    );
    Ok(())
}
