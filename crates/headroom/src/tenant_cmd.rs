//! `headroom tenant ...`: create, list, show and delete tenants through a running server's
//! management API (see client.rs). A volume can only name a tenant that exists
//! (`volume create --tenant ID`), and a tenant can only be deleted once it has no volume.

use anyhow::Result;
use clap::Subcommand;
use headroom_node::api::tenants::TenantView;

use crate::client::ApiArgs;
use crate::outln;
use crate::output::{Align, Fields, Table, bytes_rate, emit, grouped, human_bytes, print_json};

#[derive(Subcommand, Debug)]
pub enum TenantCommand {
    /// Create a tenant: the TLS PSK identity or certificate CN of its NBD clients
    /// (1-128 printable ASCII characters).
    Create {
        id: String,
        /// Print the API's JSON (`TenantView`).
        #[arg(long)]
        json: bool,
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
        /// Print `{"deleted": ID}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
}

pub fn run(command: TenantCommand) -> Result<()> {
    match command {
        TenantCommand::Create { id, json, api } => {
            let view = api.client()?.create_tenant(&id)?;
            if json {
                return print_json(&view);
            }
            outln!("created tenant {}", view.id);
        }
        TenantCommand::List { json, api } => {
            let value = api.client()?.tenants_json()?;
            if json {
                return print_json(&value);
            }
            let tenants: Vec<TenantView> = serde_json::from_value(value)?;
            print_list(&tenants);
        }
        TenantCommand::Show { id, json, api } => {
            let value = api.client()?.tenant_json(&id)?;
            if json {
                return print_json(&value);
            }
            let view: TenantView = serde_json::from_value(value)?;
            print_tenant(&view);
        }
        TenantCommand::Delete { id, json, api } => {
            api.client()?.delete_tenant(&id)?;
            if json {
                return print_json(&serde_json::json!({ "deleted": id }));
            }
            outln!("deleted tenant {id}");
        }
    }
    Ok(())
}

fn baseline(view: &TenantView) -> String {
    format!(
        "{} IOPS, {}",
        grouped(view.baseline_iops),
        bytes_rate(view.baseline_bytes_per_s)
    )
}

fn print_list(tenants: &[TenantView]) {
    let mut table = Table::new(&[
        ("TENANT", Align::Left),
        ("VOLUMES", Align::Right),
        ("PROVISIONED", Align::Right),
        ("ALLOCATED", Align::Right),
        ("BASELINE", Align::Left),
    ]);
    for t in tenants {
        table.row(vec![
            t.id.clone(),
            t.volumes.to_string(),
            human_bytes(t.provisioned_bytes),
            human_bytes(t.allocated_bytes),
            baseline(t),
        ]);
    }
    table.print();
}

fn print_tenant(view: &TenantView) {
    let mut fields = Fields::new();
    fields.add("tenant", view.id.clone());
    fields.add("volumes", view.volumes.to_string());
    fields.add("provisioned", human_bytes(view.provisioned_bytes));
    fields.add("allocated", human_bytes(view.allocated_bytes));
    fields.add("baseline", baseline(view));
    fields.add("created", format!("{} (Unix time, s)", view.created_unix_s));
    emit(&fields.render());
}
