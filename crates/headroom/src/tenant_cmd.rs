//! `headroom tenant ...`: create, list, show and delete tenants through a running server's
//! management API (see client.rs). A volume can only name a tenant that exists
//! (`volume create --tenant ID`), and a tenant can only be deleted once it has no volume.

use anyhow::Result;
use clap::Subcommand;
use headroom_node::api::tenants::TenantView;

use crate::client::ApiArgs;
use crate::volume_cmd::{bytes_rate, human_bytes};

#[derive(Subcommand, Debug)]
pub enum TenantCommand {
    /// Create a tenant: the TLS PSK identity or certificate CN of its NBD clients
    /// (1-128 printable ASCII characters).
    Create {
        id: String,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// List tenants with their volume counts, sizes and summed baselines.
    List {
        /// Print the API's JSON (`[TenantView]`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Show one tenant.
    Show {
        id: String,
        /// Print the API's JSON (`TenantView`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Delete a tenant that has no volume left.
    Delete {
        id: String,
        #[command(flatten)]
        api: ApiArgs,
    },
}

pub fn run(command: TenantCommand) -> Result<()> {
    if let Err(err) = execute(command) {
        eprintln!("error: {err:#}");
        std::process::exit(i32::from(crate::client::exit_code_of(&err)));
    }
    Ok(())
}

fn execute(command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::Create { id, api } => {
            let view = api.client()?.create_tenant(&id)?;
            println!("created tenant {}", view.id);
        }
        TenantCommand::List { json, api } => {
            let value = api.client()?.tenants_json()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                let tenants: Vec<TenantView> = serde_json::from_value(value)?;
                print_list(&tenants);
            }
        }
        TenantCommand::Show { id, json, api } => {
            let value = api.client()?.tenant_json(&id)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                let view: TenantView = serde_json::from_value(value)?;
                print_tenant(&view);
            }
        }
        TenantCommand::Delete { id, api } => {
            api.client()?.delete_tenant(&id)?;
            println!("deleted tenant {id}");
        }
    }
    Ok(())
}

fn baseline(view: &TenantView) -> String {
    format!(
        "{} IOPS, {}",
        view.baseline_iops,
        bytes_rate(view.baseline_bytes_per_s)
    )
}

fn print_list(tenants: &[TenantView]) {
    let rows: Vec<[String; 5]> = tenants
        .iter()
        .map(|t| {
            [
                t.id.clone(),
                t.volumes.to_string(),
                human_bytes(t.provisioned_bytes),
                human_bytes(t.allocated_bytes),
                baseline(t),
            ]
        })
        .collect();
    let headers = ["TENANT", "VOLUMES", "PROVISIONED", "ALLOCATED", "BASELINE"];
    let widths: Vec<usize> = (0..headers.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([headers[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: [&str; 5]| {
        let mut out = String::new();
        for (c, cell) in cells.iter().enumerate() {
            if c + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        println!("{}", out.trim_end());
    };
    line(headers);
    for r in &rows {
        line([&r[0], &r[1], &r[2], &r[3], &r[4]]);
    }
}

fn print_tenant(view: &TenantView) {
    println!("tenant       {}", view.id);
    println!("volumes      {}", view.volumes);
    println!("provisioned  {}", human_bytes(view.provisioned_bytes));
    println!("allocated    {}", human_bytes(view.allocated_bytes));
    println!("baseline     {}", baseline(view));
    println!("created      {} (Unix time, s)", view.created_unix_s);
}
