//! `headroom token ...`: create, list and revoke the node's scoped API tokens through its
//! management API (see client.rs), so a change takes effect on the server's next request,
//! without a restart, and lands in its audit log. Creating and revoking need an admin token.
//!
//! Rotation: `token create` a new one, move its users over, `token revoke` the old one.

use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use headroom_node::api::tokens::{CreateToken, Scope, TokenView};

use crate::client::ApiArgs;
use crate::outln;
use crate::output::{Align, Table, print_json};

/// `--scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScopeArg {
    /// Everything.
    Admin,
    /// GET and HEAD only: metrics, the dashboard, lists.
    Read,
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Create a token and print its secret (once: the server keeps only its hash).
    Create {
        #[arg(long, value_enum)]
        scope: ScopeArg,
        /// A name to list and revoke it by (1-64 characters of A-Z a-z 0-9 . _ -).
        #[arg(long)]
        name: Option<String>,
        /// Print the API's JSON (`CreatedToken`, with the secret).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// List the tokens (never their secrets), the bootstrap token first.
    List {
        /// Print the API's JSON (`[TokenView]`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
    /// Revoke a token by id or name: its next request is refused (401).
    Revoke {
        id_or_name: String,
        /// Print the API's JSON (the revoked `TokenView`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        api: ApiArgs,
    },
}

pub fn run(command: TokenCommand) -> Result<()> {
    match command {
        TokenCommand::Create {
            scope,
            name,
            json,
            api,
        } => {
            let scope = match scope {
                ScopeArg::Admin => Scope::Admin,
                ScopeArg::Read => Scope::Read,
            };
            let created = api.client()?.create_token(&CreateToken { scope, name })?;
            if json {
                return print_json(&created);
            }
            // The secret alone on stdout, so `$(headroom token create ...)` captures it.
            outln!("{}", created.secret);
            eprintln!(
                "created {} token {}{} (the secret above is shown once)",
                created.token.scope.as_str(),
                created.token.id,
                created
                    .token
                    .name
                    .as_deref()
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default()
            );
        }
        TokenCommand::List { json, api } => {
            let value = api.client()?.get_json("/v1/tokens")?;
            if json {
                return print_json(&value);
            }
            let tokens: Vec<TokenView> = serde_json::from_value(value)?;
            let mut table = Table::new(&[
                ("ID", Align::Left),
                ("NAME", Align::Left),
                ("SCOPE", Align::Left),
                ("CREATED (UNIX MS)", Align::Right),
            ]);
            for t in &tokens {
                table.row(vec![
                    t.id.clone(),
                    t.name.clone().unwrap_or_else(|| "-".to_string()),
                    t.scope.as_str().to_string(),
                    t.created_unix_ms.to_string(),
                ]);
            }
            table.print();
        }
        TokenCommand::Revoke {
            id_or_name,
            json,
            api,
        } => {
            let value = api.client()?.revoke_token(&id_or_name)?;
            if json {
                return print_json(&value);
            }
            let view: TokenView = serde_json::from_value(value)?;
            outln!("revoked token {}", view.id);
        }
    }
    Ok(())
}
